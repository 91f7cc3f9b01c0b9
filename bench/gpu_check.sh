#!/usr/bin/env bash
# One short device session: GPU tests, the device-path variants, and the fresh-process CUDA arms.
# Usage: bash bench/gpu_check.sh OUTDIR   (expects weightlift importable: PYTHONPATH or pip install)
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
{ nproc; free -g; python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"; } >> "$out/gpu.txt" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/local/test_load_gpu.py tests/memory/test_targets.py tests/remote/test_server.py tests/local/test_load.py tests/remote/test_client.py tests/test_hf.py tests/test_integrity.py > "$out/pytest.txt" 2>&1
tail -5 "$out/pytest.txt"
timeout 150 python3 bench/gpu_variants.py --size-gib 4 --rounds 3 --json "$out/gpu_variants.json" > "$out/gpu_variants.txt" 2>&1
cat "$out/gpu_variants.txt"
timeout 200 python3 bench/load.py --size-gib 2 --runs 5 --settle 5 --arms wl.cuda,safetensors.cuda --json "$out/bench_cuda.json" > "$out/bench_cuda.txt" 2>&1
tail -25 "$out/bench_cuda.txt"
