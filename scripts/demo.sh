#!/usr/bin/env bash
# Build krasis, synthesize the `tiny` model and generate text from it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p krasis-cli
out="${KRASIS_DEMO_DIR:-target/demo-tiny}"
./target/release/krasis synth --preset tiny --out "$out" --force
./target/release/krasis generate --model "$out" --prompt "${1:-Once upon a time}" --max-new-tokens 32 --ignore-eos
