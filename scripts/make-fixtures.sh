#!/usr/bin/env bash
# The HF oracle fixtures (scripts/make-fixtures.py): six tiny random DeepSeek-V2/V3 and Qwen3-MoE
# checkpoints with transformers' float64 outputs on them, and quant_bounds.json.
#
# usage: scripts/make-fixtures.sh [OUT] [--only NAME ...]
#   OUT defaults to .fixtures in the checkout (git-ignored), where the tests look when
#   KRASIS_FIXTURES is unset and ../shared/fixtures does not exist.
# Python: KRASIS_FIXTURE_PYTHON if it has torch, transformers, safetensors and numpy (CI passes the
# GGUF fixtures' venv), else a venv in OUT/.venv made here from PyPI (torch is large: ~3 GB with
# its CUDA libraries, though only the CPU is used). About 20 s on 2 idle cores once installed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/.fixtures
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT=$1; shift; fi
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)

PY=${KRASIS_FIXTURE_PYTHON:-$OUT/.venv/bin/python}
if ! "$PY" -c "import torch, transformers, safetensors, numpy, tokenizers" 2>/dev/null; then
    echo "make-fixtures: creating $OUT/.venv (torch, transformers, safetensors, numpy)"
    python3 -m venv "$OUT/.venv"; PY=$OUT/.venv/bin/python
    "$PY" -m pip install -q --upgrade pip >/dev/null
    "$PY" -m pip install -q torch transformers safetensors numpy
fi
t0=$SECONDS
"$PY" "$ROOT/scripts/make-fixtures.py" "$OUT" "$@"
echo "make-fixtures: $((SECONDS - t0)) s; run the tests on them with KRASIS_FIXTURES=$OUT"
