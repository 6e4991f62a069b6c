#!/usr/bin/env bash
# Sets up a fresh machine: system packages, a venv with torch 2.13.0 (CPU),
# the C++ core built into hyperparallel._C, and the C++ test build.
# Safe to rerun: each step is skipped or incremental when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v ccache >/dev/null || [ ! -e /usr/include/gtest/gtest.h ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ccache libgtest-dev g++ >/dev/null
  else
    echo "setup: install ccache and libgtest-dev (sudo apt-get install ccache libgtest-dev)" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch first and pinned, so that nothing below can pull another build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -r requirements.txt
# --no-build-isolation: build against the torch installed above.
.venv/bin/pip install -q --no-build-isolation -e .

cmake -S . -B build/cpp -G Ninja -DHP_BUILD_PYTHON=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp
