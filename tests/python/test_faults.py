"""A rank killed or frozen mid-collective becomes a clear error on every other rank, not a hang."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hyperparallel.launch import free_port

# Each rank loops over collectives until it is told to stop or its peer fails.
RANK_PROGRAM = """
import sys, torch, hyperparallel as hp
torch.set_num_threads(1)
hp.comm.init()
x = torch.ones(1 << 20)
print("looping", flush=True)
while True:
    hp.comm.all_reduce(x, op="avg")
    hp.comm.reduce_scatter_tensor(torch.empty_like(hp.comm.local_rows(x)), x)
"""


def _leftovers() -> list[str]:
    prefix = f"hp-{os.getuid()}-"
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def start_ranks(world: int, heartbeat_timeout: float, program: str = RANK_PROGRAM) -> list[subprocess.Popen]:
    """``world`` ranks of one node running ``program`` as plain processes (torchrun's variables set
    by hand, so that a test can kill or stop one); returns once each has printed "looping"."""
    port = free_port()
    ranks = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   HP_HEARTBEAT_TIMEOUT=str(heartbeat_timeout))
        ranks.append(subprocess.Popen([sys.executable, "-c", program], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for process in ranks:
        assert process.stdout.readline().strip() == "looping", process.stderr.read()
    time.sleep(0.5)  # well inside the loop: the victim dies mid-collective
    return ranks


def fail_one(ranks: list[subprocess.Popen], victim: int, how: str) -> None:
    """Kills (or stops) rank ``victim`` and checks that every other rank exits within 30 s with a
    FabricError naming it; then ends every process."""
    started = time.monotonic()
    os.kill(ranks[victim].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    try:
        for rank, process in enumerate(ranks):
            if rank == victim:
                continue
            _, stderr = process.communicate(timeout=30)
            assert time.monotonic() - started < 30
            assert process.returncode != 0
            assert "FabricError" in stderr, stderr[-2000:]
            expected = "died" if how == "killed" else "stopped answering"
            assert f"rank {victim} (local rank {victim}, pid {ranks[victim].pid}) {expected}" in stderr, stderr[-2000:]
    finally:
        for process in ranks:
            process.kill()
            process.wait()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_failed_rank_is_named_within_30s_and_dev_shm_is_clean(how):
    fail_one(start_ranks(3, heartbeat_timeout=5.0), victim=1, how=how)
    assert _leftovers() == []


def test_next_job_sweeps_what_a_killed_job_left():
    """A job killed while handing out a segment leaves its name; the next job removes it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = f"/dev/shm/hp-{os.getuid()}-{child.pid}-deadbeef-0-3"
    with open(stale, "wb") as file:
        file.write(b"x" * 4096)
    ranks = start_ranks(2, heartbeat_timeout=5.0)
    for process in ranks:
        process.kill()
        process.wait()
    assert not os.path.exists(stale)
    assert _leftovers() == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a private /dev/shm")
def test_a_full_dev_shm_is_an_error_naming_the_fix():
    """A 1 MiB /dev/shm in a private mount namespace: the 4 MiB buffer is refused when it is
    made (fallocate), with the fix, not a SIGBUS when it is first touched."""
    program = "import torch, hyperparallel as hp; hp.comm.init(); hp.comm.shared_empty((1 << 20,))"
    command = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && {sys.executable} -c '{program}'"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", command], check=False, capture_output=True, text=True,
                            timeout=120)
    if "Traceback" not in result.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {result.stderr.strip()[-300:]}")
    assert "cannot reserve" in result.stderr and "Free space in /dev/shm" in result.stderr, result.stderr
    assert result.returncode == 1, result.stderr
