#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU (the lent H200 machine, or your own), build the
# extension against the torch that is there, run the tests marked `gpu`, then the GPU benchmarks.
# Logs go to $LOGS (default: $OUT, itself runs/gpu_check by default). Each step has its own time
# limit and the script goes on after a failed step, so that one run reports everything; it exits
# non-zero if any step failed.
#
#   bash scripts/gpu_check.sh                 # everything: build about 2 minutes (seconds with HP_PREBUILT),
#                                             # the test files at once, then the benchmarks alone (comm, then
#                                             # headline, printing each part as it ends); with a prebuilt _C
#                                             # (rebuilt after any change to csrc/) it is meant to fit one
#                                             # 10-minute device call, whose logs come back even if it runs out
#                                             # (then run the steps it did not reach: STEPS="headline")
#   STEPS="build test" bash scripts/gpu_check.sh
#   HP_PREBUILT=dir bash scripts/gpu_check.sh # use dir/_C*.so if it imports (built elsewhere with
#                                             # -DHP_TORCH_PREFIX=<that machine's torch>), else build
#   GPU_TESTS="tests/python/test_gpu_optim.py" bash scripts/gpu_check.sh   # some of the gpu tests
#   TEST_LIMIT=200 bash scripts/gpu_check.sh  # the test step's limit in seconds (default 360: with probe
#                                             # and a 200 s build, one 10-minute device call)
#   LOGS=/tmp/gc bash scripts/gpu_check.sh    # logs there, and packed into $OUT/gpu_check-logs.tgz after every
#                                             # step: the device tool brings back 8 files of $OUT, a run writes a
#                                             # dozen logs, and a call cut short keeps the finished steps' logs
#
# Nothing is installed from a package index: the build uses that machine's cmake, ninja, nvcc and
# torch (>= 2.11, with CUDA). Wheels in .whl/ (e.g. the transformers version CI pins) are put on
# PYTHONPATH first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
LOGS=${LOGS:-$OUT}
mkdir -p "$OUT" "$LOGS"
STEPS=${STEPS:-"probe build test comm headline"}
# The newest first: what has not yet run on a GPU comes before what has (the bars' tests first).
GPU_TESTS=${GPU_TESTS:-"tests/python/test_gpu_optim.py tests/python/test_gpu_nn.py tests/python/test_gpu_train.py tests/python/test_gpu_fsdp.py tests/python/test_gpu_fsdp_edges.py tests/python/test_gpu_comm.py"}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# A wait that no peer will ever end (a bug) raises within a minute, not after the step's whole limit.
export HP_TIMEOUT=${HP_TIMEOUT:-60}
failed=()

step() {  # step NAME SECONDS COMMAND...: runs it under a limit, logs to $LOGS/NAME.log
  local name=$1 limit=$2
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" bash -c "$*" >"$LOGS/$name.log" 2>&1
  local status=$?
  echo "== $name: exit $status after $((SECONDS - start)) s"
  tail -n 25 "$LOGS/$name.log"
  [[ $status == 0 ]] || failed+=("$name")
  [[ $LOGS -ef $OUT ]] || tar czf "$OUT/gpu_check-logs.tgz" -C "$LOGS" .
}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hp-site .whl/*.whl \
    && export PYTHONPATH=/tmp/hp-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

probe() {
  nvidia-smi
  "$PYTHON" - <<'EOF'
import sys, sysconfig, torch, transformers
print("python", sys.version.split()[0], "include", sysconfig.get_paths()["include"])
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__)
EOF
  nvcc --version | tail -1
  cmake --version | head -1
}

build() {
  if [[ -n ${HP_PREBUILT:-} ]] && cp "$HP_PREBUILT"/_C*.so hyperparallel/ &&
    "$PYTHON" -c "from hyperparallel import _C; print('prebuilt; device backends:', _C.device_backends())"; then
    return 0
  fi
  # Plain cmake: the extension only, against this machine's torch; then into the package.
  local python
  python=$(command -v "$PYTHON")
  [[ $python == /* ]] || python=$PWD/$python
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DHP_BUILD_TESTS=OFF -DHP_CUDA=ON \
    -DPython3_EXECUTABLE="$python" -DPython3_FIND_VIRTUALENV=FIRST &&
    cmake --build build/gpu -j "$(nproc)" &&
    cp build/gpu/_C*.so hyperparallel/ &&
    "$PYTHON" -c "import hyperparallel as hp; from hyperparallel import _C; print('device backends:', _C.device_backends())"
}

tests() {
  # A hung test fails alone (pytest-timeout, where installed) instead of taking the step's time;
  # a file still running near the step's limit is interrupted (SIGINT), so that pytest says
  # which tests passed, failed or were running.
  local per_test=() pids=() names=() status=0 file i
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=150)
  # A process per file, all files at once (each log in $LOGS/<file>.log): a kernel's fault poisons
  # its process's CUDA context, not the other files', and the files' runs, mostly process starts
  # and tiny models, overlap on the GPU instead of queueing for scarce device time. Correctness
  # only: the benchmarks run after, alone. Kernels launch synchronously in test_gpu_nn, so a
  # fault names the kernel that made it.
  for file in $GPU_TESTS; do
    names+=("$(basename "$file" .py)")
    (
      [[ $file == *test_gpu_nn.py ]] && export CUDA_LAUNCH_BLOCKING=1
      exec timeout -s INT --kill-after=10 $((TEST_LIMIT - 25)) \
        "$PYTHON" -m pytest -v -m gpu -p no:cacheprovider -rA --durations=8 "${per_test[@]}" "$file"
    ) >"$LOGS/${names[-1]}.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || status=1
    echo "-- ${names[$i]}: $(tail -n 1 "$LOGS/${names[$i]}.log")"
  done
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv  # what the tests left on the GPU
  return $status
}

TEST_LIMIT=${TEST_LIMIT:-360}
export PYTHON OUT LOGS HP_PREBUILT GPU_TESTS TEST_LIMIT
export -f probe build tests
step probe 30 probe
step build 200 build
step test $TEST_LIMIT tests
# The benchmarks alone on the GPU: comm first (the shorter), headline's parts print as they end.
step comm 150 '"$PYTHON" bench/gpu_comm.py --max-mib 1024 --repeats 8 --json "$LOGS/gpu_comm.json"'
step headline 330 '"$PYTHON" bench/gpu_headline.py'

if ((${#failed[@]})); then
  echo "gpu_check: failed steps: ${failed[*]} (logs in $LOGS)"
  exit 1
fi
echo "gpu_check: all steps passed (logs in $LOGS)"
