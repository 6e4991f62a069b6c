#!/usr/bin/env bash
# Sets up (see setup.sh; with the LlamaFactory environment the integration tests run in),
# then runs every test: GoogleTest through ctest, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-llamafactory
ctest --test-dir build/cpp --output-on-failure
.venv/bin/python -m pytest -q "$@"
