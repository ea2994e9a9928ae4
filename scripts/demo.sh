#!/usr/bin/env bash
# Build krasis, synthesize the `tiny` model and generate text from it (random weights, so the
# text is random too). Honours CARGO_TARGET_DIR: it runs the binary cargo reports building.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "demo: building the krasis binary (cargo build --release -p krasis-cli); the first build" \
    "takes minutes (README.md, \"Set up\", says what was measured), later ones a few seconds" >&2
krasis=$(scripts/build-krasis.sh)
out="${KRASIS_DEMO_DIR:-$(dirname "$(dirname "$krasis")")/demo-tiny}"
"$krasis" synth --preset tiny --out "$out" --force
"$krasis" generate --model "$out" --prompt "${1:-Once upon a time}" --max-new-tokens 32 --ignore-eos
