#!/usr/bin/env bash
# The first thing a machine with a CUDA GPU runs: about 8 minutes, loud on any failure.
#
#   bash bench/gpu_check.sh            (from the repository root; summary in $OUT or a printed path)
#
# Stages, each under its own time limit; the script goes on after a failed stage (the summary
# should say as much as it can) and exits non-zero if any stage failed or ran no test:
#   0 setup      weightlift importable from this tree: `pip install -e . --no-deps` if not, and
#                the few test packages only where missing. The installed (CUDA) torch is kept:
#                the test extra pins a CPU torch, so it is never installed here.
#   1 preflight  the GPU, torch and CUDA versions; a CUDA device present; the gpu tests collected
#                (more than zero). A failed preflight stops the script: nothing else can pass.
#   2 gpu tests  every test marked `gpu`, and only those; none may skip.
#   3 findings   bench/gpu_findings.py: a short repro of each CUDA finding, PASS or FAIL each.
#   4 h2d        bench/gpu_variants.py (weightlift against pinned copies, in one process) and
#                bench/load.py wl.cuda against safetensors.cuda (fresh processes, base.h2d).
# The summary (markdown, to paste into bench/RESULTS.md) goes to $OUT/gpu_summary.md when OUT is
# set, else to a temporary folder the script prints. WL_GPU_TESTS names the test folder (tests).
set -euo pipefail

cd "$(dirname "$0")/.."
repo=$(pwd)
tests=${WL_GPU_TESTS:-tests}
if [[ -n "${OUT:-}" ]]; then out=$OUT; else out=$(mktemp -d "${TMPDIR:-/tmp}/wl-gpu-check.XXXXXX"); fi
mkdir -p "$out"
summary=$out/gpu_summary.md
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
failed=()
results=()

note() { printf '%s\n' "$*" | tee -a "$summary"; }

# stage NAME SECONDS CMD...: run CMD under `timeout`, its output in $out/NAME.txt, record the outcome
stage() {
    local name=$1 limit=$2 rc=0 t0=$SECONDS
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.txt" 2>&1 || rc=$?
    tail -n 30 "$out/$name.txt"
    local took=$((SECONDS - t0))
    if [[ $rc -eq 0 ]]; then
        results+=("| $name | PASS | ${took}s |")
    else
        local why="exit $rc"
        [[ $rc -eq 124 || $rc -eq 137 ]] && why="timed out after ${limit}s"
        results+=("| $name | FAIL ($why) | ${took}s |")
        failed+=("$name")
        echo "!! $name FAILED: $why (output: $out/$name.txt)"
    fi
    return 0
}

finish() {
    {
        echo
        echo "| stage | result | time |"
        echo "| --- | --- | --- |"
        printf '%s\n' "${results[@]}"
        echo
        echo "Untested on one GPU (not skipped quietly): NCCL between two GPUs (weightlift.distributed"
        echo "group loads and the vLLM tensor-parallel case), a second device (a bare \"cuda\" after"
        echo "torch.cuda.set_device(1) resolving to cuda:1 in every loader thread)."
    } >> "$summary"
    echo "summary: $summary"
    if [[ ${#failed[@]} -gt 0 ]]; then
        echo "gpu_check FAILED: ${failed[*]}" | tee -a "$summary"
        exit 1
    fi
    echo "gpu_check passed" | tee -a "$summary"
}

: > "$summary"
note "## GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
note

# 0 setup: this tree's weightlift, torch as installed (never replaced: --no-deps, and only what is missing)
where=$(cd / && PYTHONPATH= "$py" -c 'import os, weightlift; print(os.path.dirname(os.path.dirname(weightlift.__file__)))' 2>/dev/null || true)
if [[ "$where" != "$repo" ]]; then
    echo "== setup: pip install -e . --no-deps (weightlift from this tree; torch kept as installed)"
    if ! timeout 120 "$py" -m pip install -q --no-build-isolation --no-deps -e . > "$out/setup.txt" 2>&1; then
        note "- setup: the editable install failed (see setup.txt); this tree is used through PYTHONPATH"
    fi
fi
missing=()
for mod in numpy ml_dtypes gguf blake3 zstandard pytest hypothesis safetensors; do
    "$py" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    echo "== setup: pip install ${missing[*]} (missing; torch is not touched)"
    timeout 180 "$py" -m pip install -q "${missing[@]}" >> "$out/setup.txt" 2>&1 || true
    for mod in "${missing[@]}"; do
        "$py" -c "import $mod" 2>/dev/null || note "- setup: $mod is missing and could not be installed"
    done
fi
"$py" -c 'import torch, pytest' 2>/dev/null || { note "- FAIL: torch (a CUDA build) and pytest are needed"; exit 1; }

# 1 preflight
echo "== preflight"
pre=0
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1; then
    echo "none (nvidia-smi failed or is missing)" > "$out/gpu.txt"
fi
note "- GPU: $(head -n 1 "$out/gpu.txt")"
note "- host: $(nproc) cores, $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}')"
note "- $("$py" -c 'import torch, numpy; print("torch", torch.__version__, "CUDA", torch.version.cuda, "numpy", numpy.__version__)')"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)'; then
    note "- FAIL: no CUDA device (torch.cuda.is_available() is False; torch ${py} sees no GPU)"
    pre=1
fi
crc=0
"$py" -m pytest --collect-only -q -m gpu -p no:cacheprovider --continue-on-collection-errors "$tests" \
    > "$out/collect.txt" 2>&1 || crc=$?
collected=$(grep -c '::' "$out/collect.txt" || true)
note "- $collected gpu tests collected (pytest --collect-only -m gpu $tests)"
if [[ $crc -ne 0 && $crc -ne 5 ]]; then  # a module that does not import: its tests are not run
    note "- FAIL: collecting the tests had errors (exit $crc, see collect.txt):"
    grep -E '^ERROR' "$out/collect.txt" | head -n 5 | sed 's/^/  - /' | tee -a "$summary" || true
    results+=("| collect | FAIL (exit $crc) | - |")
    failed+=(collect)
fi
if [[ "$collected" -eq 0 ]]; then
    note "- FAIL: 0 gpu tests collected"
    pre=1
fi
if [[ $pre -ne 0 ]]; then
    results+=("| preflight | FAIL | - |")
    failed+=(preflight)
    finish
fi
results+=("| preflight | PASS | - |")

# 2 every gpu-marked test, and only those; a skip on a GPU machine is a failure too
stage gpu_tests 240 "$py" -m pytest -q -p no:cacheprovider -m gpu -rs --continue-on-collection-errors "$tests"
passed=$(grep -Eo '[0-9]+ passed' "$out/gpu_tests.txt" | tail -n 1 | grep -Eo '[0-9]+' || echo 0)
note "- gpu tests: $passed passed of $collected collected"
if [[ "$passed" -ne "$collected" ]]; then  # a gpu test skipped on a GPU machine did not run
    note "- FAIL: $((collected - passed)) gpu tests did not pass (skipped or failed):"
    grep -E '^(FAILED|ERROR|SKIPPED)' "$out/gpu_tests.txt" | head -n 10 | sed 's/^/  - /' | tee -a "$summary" || true
    failed+=(gpu_tests_all_ran)
fi

# 3 a repro of each CUDA finding
stage findings 75 "$py" bench/gpu_findings.py
grep -E '^(PASS|FAIL|UNTESTED)' "$out/findings.txt" | sed 's/^/- /' >> "$summary" || true

# 4 host-to-device: in-process variants against pinned copies, then fresh-process arms
stage h2d_variants 80 "$py" bench/gpu_variants.py --size-gib 2 --rounds 2 --json "$out/gpu_variants.json"
stage h2d_load 120 "$py" bench/load.py --size-gib 2 --runs 3 --settle 2 --no-profile \
    --arms wl.cuda,safetensors.cuda --baseline safetensors.cuda --json "$out/load_cuda.json"
{
    echo
    echo '```'
    tail -n 25 "$out/h2d_variants.txt"
    echo
    tail -n 25 "$out/h2d_load.txt"
    echo '```'
} >> "$summary"
finish
