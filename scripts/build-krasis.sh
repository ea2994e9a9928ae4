#!/usr/bin/env bash
# Build the release `krasis` binary and print its path: wherever the target directory is
# (CARGO_TARGET_DIR, .cargo/config), as cargo reports it in its JSON artifact messages (on
# stdout; progress and compiler errors still go to stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
krasis=$(cargo build --release -p krasis-cli --bin krasis --message-format=json-render-diagnostics |
    grep -o '"executable":"[^"]*/krasis"' | tail -n 1 | cut -d'"' -f4)
if [ -z "$krasis" ] || [ ! -x "$krasis" ]; then
    echo "build-krasis: cargo did not report the krasis binary" >&2
    exit 1
fi
echo "$krasis"
