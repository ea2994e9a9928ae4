#!/usr/bin/env bash
# Compiles every krasis-gpu kernel through NVRTC for sm_80, sm_89 and sm_90 — no GPU, no CUDA
# toolkit needed. libnvrtc comes from NVIDIA's PyPI wheel (nvidia-cuda-nvrtc-cu12, ~90 MB download,
# cached under target/nvrtc-wheel/ so later runs skip it). Fails on any compile error.
#
#   scripts/nvrtc-check.sh            # as CI runs it
#   KRASIS_NVRTC_LIB=/usr/local/cuda/lib64/libnvrtc.so.13 scripts/nvrtc-check.sh   # a local NVRTC instead
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_VERSION="${KRASIS_NVRTC_WHEEL_VERSION:-12.9.86}"
WHEEL_DIR="${KRASIS_NVRTC_WHEEL_DIR:-$PWD/target/nvrtc-wheel/$WHEEL_VERSION}"
WHEEL_LIB="$WHEEL_DIR/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"

if [ -z "${KRASIS_NVRTC_LIB:-}" ]; then
    if [ ! -f "$WHEEL_LIB" ]; then
        echo "== nvrtc-check: installing nvidia-cuda-nvrtc-cu12==$WHEEL_VERSION from PyPI into $WHEEL_DIR"
        PY=python3
        command -v "$PY" >/dev/null 2>&1 || PY=python
        rm -rf "$WHEEL_DIR.partial"
        "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --no-cache-dir \
            --only-binary=:all: --target "$WHEEL_DIR.partial" "nvidia-cuda-nvrtc-cu12==$WHEEL_VERSION"
        rm -rf "$WHEEL_DIR"
        mv "$WHEEL_DIR.partial" "$WHEEL_DIR"
    fi
    export KRASIS_NVRTC_LIB="$WHEEL_LIB"
fi
echo "== nvrtc-check: KRASIS_NVRTC_LIB=$KRASIS_NVRTC_LIB"

export KRASIS_REQUIRE_NVRTC=1
KRASIS_NVRTC_CACHE="$(mktemp -d)"
export KRASIS_NVRTC_CACHE
trap 'rm -rf "$KRASIS_NVRTC_CACHE"' EXIT

cargo test -p krasis-gpu --test nvrtc_compile -- --nocapture --test-threads=1
