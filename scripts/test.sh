#!/usr/bin/env bash
# The README's test command: sets up if needed, then runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
