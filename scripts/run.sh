#!/usr/bin/env bash
# Sets up (see setup.sh), then runs the main job on its embedded default:
# a 2-rank measurement of the fabric's collectives against Gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python bench/collectives.py --max-mib 64 "$@"
