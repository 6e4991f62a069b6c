#!/usr/bin/env bash
# Sets up a fresh machine: system packages, a venv with torch 2.13.0 (CPU),
# CUDA 13.0's compiler (the machine's nvcc, else pinned PyPI wheels), the C++
# core built into hyperparallel._C, and the C++ test build. Without a GPU the
# CUDA kernels are still compiled (warnings are errors), so CI keeps them honest.
# --with-llamafactory also makes .venv-llamafactory: LlamaFactory 0.9.5 and its pins
# (requirements-llamafactory.txt) on the same torch, hyperparallel installed into it.
# Safe to rerun: each step is skipped or incremental when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

with_llamafactory=0
for arg in "$@"; do
  case "$arg" in
    --with-llamafactory) with_llamafactory=1 ;;
    *) echo "setup: unknown argument $arg (known: --with-llamafactory)" >&2; exit 2 ;;
  esac
done

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

# nvcc: the machine's if it has one, else CUDA 13.0's compiler wheels in the
# venv. Their layout needs two links: nvcc.profile looks for lib64, and
# CMake's FindCUDAToolkit for the unversioned libcudart.so.
if ! command -v nvcc >/dev/null; then
  .venv/bin/pip install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
    nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
  cuda=$(.venv/bin/python -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13'))")
  ln -sfn lib "$cuda/lib64"
  ln -sfn libcudart.so.13 "$cuda/lib/libcudart.so"
  export PATH="$cuda/bin:$PATH" CUDAToolkit_ROOT="$cuda"
fi
# --no-build-isolation: build against the torch installed above.
.venv/bin/pip install -q --no-build-isolation -e .

cmake -S . -B build/cpp -G Ninja -DHP_BUILD_PYTHON=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp

if [ "$with_llamafactory" = 1 ]; then
  lf=.venv-llamafactory
  if [ ! -x $lf/bin/python ]; then
    "$PYTHON" -m venv $lf
  fi
  $lf/bin/pip install -q torch==2.13.0
  # The constraint keeps every package below on that torch.
  $lf/bin/pip install -q -c <(echo torch==2.13.0) -r requirements-llamafactory.txt
  $lf/bin/pip install -q --no-deps llamafactory==0.9.5 torchaudio==2.11.1
  # torchaudio's PyPI libraries are CUDA builds; without them it loads as pure Python
  # (requirements-llamafactory.txt says why that is enough).
  rm -f $lf/lib/python3*/site-packages/torchaudio/lib/*.so
  # Its own build folder, but against .venv's torch: the very same 2.13.0 build, at a path
  # whose objects ccache already holds (a cold build is ~7 minutes on 2 cores; this ~30 s).
  torch_dir=$(.venv/bin/python -c "import os, torch; print(os.path.dirname(torch.__file__))")
  $lf/bin/pip install -q --no-build-isolation --no-deps -C build-dir=build/llamafactory \
    -C cmake.define.HP_TORCH_PREFIX="$torch_dir" -e .
fi
