#!/usr/bin/env bash
# Build ggml (CPU + RPC, Release, static) from SRC_DIR and the two programs into OUT_DIR.
#   bench/llamacpp/build.sh SRC_DIR OUT_DIR [JOBS]
# SRC_DIR: a ggml source tree (git clone https://github.com/ggml-org/ggml, or llama.cpp's ggml/).
# Leaves OUT_DIR/rpc_server and OUT_DIR/rpc_upload. Build outside the repository.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 SRC_DIR OUT_DIR [JOBS]" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "$1" && pwd)"
out="$2"
jobs="${3:-2}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cmake -S "$here" -B "$out/build" -DGGML_SRC="$src" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_RPC=ON -DGGML_CPU=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
cmake --build "$out/build" --target rpc_server rpc_upload -j "$jobs"
cp "$out/build/rpc_server" "$out/build/rpc_upload" "$out/"
commit="unknown"
if [ "$(git -C "$src" rev-parse --show-toplevel 2>/dev/null)" = "$src" ]; then
    commit="$(git -C "$src" rev-parse HEAD)"  # a clone of ggml
elif [ -f "$src/.ggml-commit" ]; then          # an exported tree: echo COMMIT > SRC_DIR/.ggml-commit
    commit="$(cat "$src/.ggml-commit")"
fi
echo "$commit" > "$out/ggml-commit"
echo "built $out/rpc_server and $out/rpc_upload from ggml $commit"
