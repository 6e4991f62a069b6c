"""hp.checkpoint in one process: torch.save-exact items, DCP interop, integrity checks,
the manager's retention, async saves that overlap training and survive a kill."""

from __future__ import annotations

import io
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import hyperparallel.checkpoint as ckpt
from hyperparallel import _C
from hyperparallel.checkpoint._storage import Writer, storage_type


def sample_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {
        "w": torch.randn(33, 7),
        "half": torch.randn(4, 5, 6).bfloat16(),
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(10),
        "empty": torch.zeros(0, 3),
        "step": 3 + seed,
        "lr": 0.25,
        "rng": torch.get_rng_state(),
        "py_rng": random.Random(seed).getstate(),
        "loader": {"epoch": 1, "position": 17, "order": [2, 0, 1], "raw": b"\x00\xff"},
    }


def blank(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.full_like(value, 7) if value.numel() else torch.empty_like(value)
        elif isinstance(value, dict):
            out[key] = blank(value)
        else:
            out[key] = None
    return out


def assert_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        elif isinstance(value, dict):
            assert_equal(got[key], value)
        else:
            assert got[key] == value, key


@pytest.mark.parametrize(
    "tensor",
    [torch.arange(6.0).reshape(2, 3), torch.tensor(3.0), torch.randn(2, 3, 4, 5, 6).bfloat16(), torch.zeros(0, 4),
     torch.arange(300).reshape(300, 1), torch.ones(70000, dtype=torch.int8), torch.ones(5, dtype=torch.bool),
     torch.randn(3).half(), torch.randn(2, 2, dtype=torch.complex64),
     # dtypes without a typed storage: torch pickles them with _rebuild_tensor_v3
     torch.randn(2, 3).to(torch.float8_e4m3fn), torch.arange(5).to(torch.uint16),
     torch.arange(4).to(torch.uint64).reshape(2, 2)],
)
def test_items_are_torch_save_bytes(tensor, tmp_path):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    assert _C.ckpt_torch_save_bytes(storage_type(tensor.dtype), tensor) == buffer.getvalue()
    # And each way between hp.checkpoint and torch DCP.
    ckpt.save({"t": tensor}, tmp_path / "hp")
    dcp.save({"t": tensor}, checkpoint_id=tmp_path / "dcp")
    for load, source in ((ckpt.load, "dcp"), (lambda s, p: dcp.load(s, checkpoint_id=p), "hp")):
        got = {"t": torch.zeros_like(tensor)}
        load(got, tmp_path / source)
        assert torch.equal(got["t"].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), source


def test_round_trip_and_dcp_interop_both_ways(tmp_path):
    state = sample_state()
    ckpt.save(state, tmp_path / "ours")
    dcp.save(state, checkpoint_id=str(tmp_path / "theirs"))
    # Same planner, same layout, same item bytes: the data files are identical.
    assert (tmp_path / "ours/__0_0.distcp").read_bytes() == (tmp_path / "theirs/__0_0.distcp").read_bytes()
    for loader, source in ((ckpt.load, "ours"), (ckpt.load, "theirs")):
        got = blank(state)
        loader(got, tmp_path / source)
        assert_equal(got, state)
    got = blank(state)
    dcp.load(got, checkpoint_id=str(tmp_path / "ours"))
    assert_equal(got, state)


def test_partial_loads_and_blocks(tmp_path):
    """Loading a block of a saved tensor (non-contiguous as well) and dtype mismatch errors."""
    state = sample_state()
    ckpt.save(state, tmp_path / "c")
    got = {"w": torch.zeros(33, 7), "step": None}
    ckpt.load(got, tmp_path / "c")
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    # A state the checkpoint does not fit: named key by key, before anything is read.
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"1 tensors differ in shape \(w is \(33, 7\) there, "
                       r"\(32, 7\) here\)$"):
        ckpt.load({"w": torch.zeros(32, 7)}, tmp_path / "c")
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"it lacks 2 keys \(extra, nested.x\) and 1 tensors "
                       r"differ in shape \(step is not a tensor there"):
        ckpt.load({"w": torch.zeros(33, 7), "step": torch.zeros(1), "extra": 1, "nested": {"x": torch.zeros(2)}},
                  tmp_path / "c")


def test_overwrite_keeps_old_until_new_is_complete(tmp_path):
    ckpt.save(sample_state(0), tmp_path / "c")
    ckpt.save(sample_state(1), tmp_path / "c")
    got = blank(sample_state(1))
    ckpt.load(got, tmp_path / "c")
    assert_equal(got, sample_state(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_corrupted_and_truncated_files_are_refused(tmp_path):
    state = sample_state()
    ckpt.save(state, tmp_path / "c")
    data = tmp_path / "c/__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp is corrupted"):
        ckpt.load(blank(state), tmp_path / "c")

    ckpt.save(state, tmp_path / "c")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp is truncated"):
        ckpt.load(blank(state), tmp_path / "c")

    ckpt.save(state, tmp_path / "c")
    data.unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp is missing"):
        ckpt.load(blank(state), tmp_path / "c")

    ckpt.save(state, tmp_path / "c")
    (tmp_path / "c/.metadata").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata"):
        ckpt.load(blank(state), tmp_path / "c")

    # A checkpoint written by torch DCP has no checksums; truncation is still caught.
    dcp.save(state, checkpoint_id=str(tmp_path / "d"))
    with open(tmp_path / "d/__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp is truncated"):
        ckpt.load(blank(state), tmp_path / "d")


def test_bad_input_errors(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="must be a dict"):
        ckpt.save([torch.zeros(2)], tmp_path / "c")
    with pytest.raises(ckpt.CheckpointError, match="keys must be str"):
        ckpt.save({1: torch.zeros(2)}, tmp_path / "c")
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.load({"w": torch.zeros(2)}, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="keep_last"):
        ckpt.CheckpointManager(tmp_path, keep_last=0)


def test_a_dcp_save_over_an_hp_checkpoint_is_named(tmp_path):
    ckpt.save({"w": torch.zeros(3), "step": 1}, tmp_path / "c")
    os.utime(tmp_path / "c/.checksums.json", (1, 1))  # written long before torch's save below
    dcp.save({"w": torch.ones(5), "step": 2, "extra": torch.ones(2)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(ckpt.CheckpointError, match="saved again by torch.distributed.checkpoint"):
        ckpt.load({"w": torch.zeros(5)}, tmp_path / "c")
    (tmp_path / "c/.checksums.json").unlink()  # what the message says to do
    state = {"w": torch.zeros(5), "step": 0}
    ckpt.load(state, tmp_path / "c")
    assert torch.equal(state["w"], torch.ones(5)) and state["step"] == 2


def test_conjugate_views_keep_their_values(tmp_path):
    view = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    ckpt.save({"c": view, "n": torch.tensor([1.0, -2.0])._neg_view()}, tmp_path / "hp")
    for load in (lambda s: ckpt.load(s, tmp_path / "hp"), lambda s: dcp.load(s, checkpoint_id=tmp_path / "hp")):
        state = {"c": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(2)}
        load(state)
        assert torch.equal(state["c"], view.resolve_conj()) and state["n"].tolist() == [-1.0, 2.0]
    # torch DCP keeps a lazy view's storage and a flag hp does not read: refused, not misread.
    dcp.save({"c": view}, checkpoint_id=tmp_path / "dcp")
    with pytest.raises(ckpt.CheckpointError, match="resolve_conj"):
        ckpt.load({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "dcp")


def test_a_save_replaces_only_a_checkpoint(tmp_path):
    """A save publishes its directory in place of the path: a user's files there are kept and the
    save refused, a file too; an empty directory or an earlier checkpoint is replaced."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes/todo.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    for taken in ("notes", "file"):
        with pytest.raises(ckpt.CheckpointError, match="save to another path, or move it away"):
            ckpt.save({"w": torch.ones(2)}, tmp_path / taken)
    assert (tmp_path / "notes/todo.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "keep me too"
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    with pytest.raises(ckpt.CheckpointError, match="cannot make the checkpoint directory"):
        ckpt.CheckpointManager(tmp_path / "file").save(1, {"w": torch.ones(2)})
    (tmp_path / "empty").mkdir()
    for round_ in range(2):  # an empty directory, then the checkpoint just written
        ckpt.save({"w": torch.full((2,), float(round_))}, tmp_path / "empty")
        state = {"w": torch.zeros(2)}
        ckpt.load(state, tmp_path / "empty")
        assert torch.equal(state["w"], torch.full((2,), float(round_)))


def test_manager_latest_and_keep_last(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path / "run", keep_last=2)
    assert manager.latest() is None and manager.load_latest(blank(sample_state())) is None
    for step in (1, 2, 3):
        assert manager.save(step, sample_state(step)) == tmp_path / "run" / f"step_{step:08d}"
    assert manager.steps() == [2, 3]
    assert manager.latest() == tmp_path / "run/step_00000003"
    got = blank(sample_state(3))
    assert manager.load_latest(got) == 3
    assert_equal(got, sample_state(3))


def test_async_save_overlaps_training(tmp_path, monkeypatch):
    """The step runs while the save is held in flight; the checkpoint holds the state at the call."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    written, release = threading.Event(), threading.Event()
    write_data = Writer.write_data

    def write_and_hold(self, plan, planner):  # the real write, then held before the publish
        result = write_data(self, plan, planner)
        written.set()
        release.wait()
        return result

    monkeypatch.setattr(Writer, "write_data", write_and_hold)
    try:
        manager = ckpt.CheckpointManager(tmp_path, keep_last=1)
        manager.save(5, {"model": model.state_dict(), "step": 5}, async_=True)
        assert written.wait(60)
        pending = manager._pending
        model(torch.randn(4, 16)).sum().backward()  # a training step while the save is in flight
        opt.step()
        assert not pending.done() and manager.latest() is None
        release.set()
        manager.wait()
    finally:
        release.set()
    assert pending.done() and manager.latest() == tmp_path / "step_00000005"
    got = {"model": {k: torch.zeros_like(v) for k, v in before.items()}, "step": 0}
    assert manager.load_latest(got) == 5
    assert_equal(got["model"], before)
    assert not torch.equal(model.weight, before["weight"])


KILLED_CHILD = textwrap.dedent(
    """
    import sys, threading, torch
    import hyperparallel.checkpoint as ckpt
    from hyperparallel.checkpoint._storage import Writer
    manager = ckpt.CheckpointManager(sys.argv[1])
    manager.save(1, {"w": torch.arange(1000.0), "step": 1})
    write_data = Writer.write_data
    def write_and_hold(self, plan, planner):  # the real write, then killed before the publish
        write_data(self, plan, planner)
        print("WRITING", flush=True)
        threading.Event().wait()
    Writer.write_data = write_and_hold
    manager.save(2, {"w": torch.arange(1000.0) * 2, "step": 2}, async_=True)
    threading.Event().wait()
    """
)


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "WRITING"
        assert (tmp_path / ".step_00000002.partial/__0_0.distcp").exists()  # step 2's data is on disk ...
        ckpt.CheckpointManager(tmp_path)  # a live save's staging directory is not swept ...
        assert (tmp_path / ".step_00000002.partial/__0_0.distcp").exists()
        with pytest.raises(ckpt.CheckpointError, match="another live process is saving"):
            ckpt.save({"w": torch.ones(3)}, tmp_path / "step_00000002")  # ... nor taken over
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.load({"w": torch.zeros(1000)}, tmp_path / "step_00000002")
    manager = ckpt.CheckpointManager(tmp_path)  # sweeps the leftover no live save holds
    assert manager.latest() == tmp_path / "step_00000001"  # ... and only step 1 is a checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    got = {"w": torch.zeros(1000), "step": 0}
    assert manager.load_latest(got) == 1 and torch.equal(got["w"], torch.arange(1000.0))
    manager.save(2, {"w": torch.ones(1000), "step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_an_async_save_still_running_at_exit_is_finished_first(tmp_path):
    """The process ends right after async_save returns: hp.comm.shutdown, at exit, waits for the save."""
    script = ("import sys, torch, hyperparallel.checkpoint as ckpt\n"
              "ckpt.async_save({'w': torch.arange(1 << 22, dtype=torch.float32)}, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "c")], check=True, timeout=120)
    got = {"w": torch.zeros(1 << 22)}
    ckpt.load(got, tmp_path / "c")
    assert torch.equal(got["w"], torch.arange(1 << 22, dtype=torch.float32))


FULL_DISK = textwrap.dedent(
    """
    import os, sys, torch
    import hyperparallel.checkpoint as ckpt
    manager = ckpt.CheckpointManager(sys.argv[1])
    manager.save(1, {"w": torch.arange(1000.0)})
    try:
        manager.save(2, {"w": torch.ones(1 << 20)})  # 4 MiB onto a 1 MiB file system
    except ckpt.CheckpointError as error:
        print("REFUSED", error)
    print("LEFT", *sorted(os.listdir(sys.argv[1])))
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a private tmpfs")
def test_a_save_that_fails_on_a_full_disk_removes_its_partial(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    # A 1 MiB tmpfs in a private mount namespace: a real ENOSPC, seen by no other process.
    command = f"mount -t tmpfs -o size=1m tmpfs {disk} && {sys.executable} {script} {disk}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", command], check=False, capture_output=True, text=True,
                            timeout=120)
    if result.returncode and "REFUSED" not in result.stdout:
        pytest.skip(f"cannot mount a private tmpfs here: {result.stderr.strip()[-300:]}")
    assert "No space left on device" in result.stdout, result.stdout + result.stderr
    assert "LEFT step_00000001\n" in result.stdout, result.stdout  # no .step_00000002.partial behind


def test_crc32_matches_zlib():
    import zlib

    rng = random.Random(0)
    for n in [*range(200), 1000, 4097, 1 << 20]:
        data, start = rng.randbytes(n), rng.getrandbits(32)
        assert _C.ckpt_crc32(data, start) == zlib.crc32(data, start), n
    a, b = rng.randbytes(12345), rng.randbytes(777)
    assert _C.ckpt_crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_file_written_in_appends_is_the_file_written_at_once(tmp_path):
    """What a save streams (an append per STAGE_BYTES) is byte for byte what one write gives;
    the size and CRC are the file's, and each tensor item reads back with torch.load."""
    import zlib

    tensors = [torch.arange(10.0), torch.randn(3, 70000).bfloat16(), torch.zeros(0, 4), torch.arange(7)]
    items = [(b"a pickled object",), *((t, storage_type(t.dtype)) for t in tensors), (b"",)]
    once = _C.CkptFileWriter(str(tmp_path / "once"))
    extents = once.append(items)
    digest = once.finish()
    parts = _C.CkptFileWriter(str(tmp_path / "parts"))
    assert parts.append(items[:2]) + parts.append([]) + parts.append(items[2:]) == extents
    assert parts.finish() == digest
    data = (tmp_path / "once").read_bytes()
    assert (tmp_path / "parts").read_bytes() == data
    assert digest == (len(data), zlib.crc32(data))
    for tensor, (offset, length) in zip(tensors, extents[1:]):
        assert torch.equal(torch.load(io.BytesIO(data[offset:offset + length])), tensor)
    with pytest.raises(RuntimeError, match="finish called twice"):
        parts.finish()
