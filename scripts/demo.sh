#!/usr/bin/env bash
# The README's first command: set up a fresh machine, then run the main job — a small
# Self-FL federation over MQTT ending in a relative FA/FR report.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/wakefl demo "$@"
