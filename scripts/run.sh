#!/usr/bin/env bash
# Sets up (see setup.sh), then runs the main job on its embedded default:
# `hyperparallel train` on 2 ranks, a tiny Qwen3-MoE learning short English
# stories (examples/default.yaml; the token file is made on the first run).
# Extra arguments go to the trainer, e.g. `bash scripts/run.sh train.steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/hyperparallel train examples/default.yaml --nproc 2 --overwrite "$@"
