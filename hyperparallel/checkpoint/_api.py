"""save / load / async_save: DCP's planning and metadata, C++ bytes, crash safety.

A save writes into ``<parent>/.<name>.partial``, fsyncs every file, records
each file's size and CRC-32 in ``.checksums.json``, and only then publishes
the directory under its name with one atomic rename (an exchange if a
checkpoint of that name exists, which is removed only afterwards). While it
runs, the coordinator holds an exclusive ``flock`` on the staging directory:
a save that fails removes it, and one that was killed leaves it unlocked for
the next save of that path or CheckpointManager's sweep to remove. A load
verifies sizes and CRCs first, each rank checking a share of the files.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hyperparallel import _C
from hyperparallel import comm as hp_comm
from hyperparallel._log import log
from hyperparallel.checkpoint._storage import (
    CheckpointError,
    CheckpointMismatchError,
    Reader,
    Writer,
    io_threads,
)

MANIFEST = ".checksums.json"
METADATA = ".metadata"


@contextlib.contextmanager
def _quiet(group):
    """Without a process group DCP warns that it saves/loads in one process: that is the intent."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _group(process_group) -> tuple[Any, int, int]:
    """(group for collectives or None, rank, world size) of this process."""
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise CheckpointError("process_group was given but torch.distributed is not initialized")
        return None, 0, 1
    group = process_group or dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _first_error(group, error: str | None) -> None:
    """Raise the same CheckpointError on every rank if any rank had one."""
    if group is None:
        if error:
            raise CheckpointError(error)
        return
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    found = [e for e in errors if e]
    if found:
        raise CheckpointError(found[0])


def _rank_failure(what: str, error: CheckpointException) -> CheckpointError:
    """DCP's per-rank failures (a BaseException holding tracebacks) as one CheckpointError."""
    failures = getattr(error, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
        return CheckpointError(f"{what} failed on rank {rank}: {type(inner).__name__}: {inner}")
    return CheckpointError(f"{what} failed: {error}")


def _check_state_dict(state_dict) -> None:
    if not isinstance(state_dict, dict):
        raise CheckpointError(
            f"state_dict must be a dict (e.g. {{'model': model.state_dict(), 'step': 3}}), got {type(state_dict).__name__}"
        )
    for key in state_dict:
        if not isinstance(key, str):
            raise CheckpointError(f"state_dict keys must be str; got {key!r}: convert the key to a string")


def _staging(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _remove_if_abandoned(staged: Path) -> bool:
    """Remove the staging directory ``staged`` unless a live save holds its lock; whether it is gone."""
    try:
        fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(staged, ignore_errors=True)
        log.info("removed %s, left by a save that did not finish", staged)
        return True
    finally:
        os.close(fd)


def _lock_new_staging(staged: Path, path: Path) -> int:
    """Make ``staged`` afresh; return a descriptor holding an exclusive flock on it until the save ends."""
    while True:
        if not _remove_if_abandoned(staged):
            raise CheckpointError(
                f"another live process is saving {path} (it holds {staged}); wait for it, or save elsewhere"
            )
        try:
            staged.mkdir(parents=True)
        except FileExistsError:
            continue  # made meanwhile by another process: look again
        fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper holding it is removing it: then make another
        try:
            if os.path.samestat(os.fstat(fd), os.stat(staged)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _check_replaceable(path: Path) -> None:
    """A save publishes its directory in place of ``path``: only an earlier checkpoint (or an
    empty directory) may be there, never a user's other files."""
    if not os.path.lexists(path) or (path / METADATA).is_file():
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return
    what = "a directory that is not a checkpoint" if path.is_dir() else "a file"
    raise CheckpointError(
        f"{path} is {what} (no {METADATA}): a save replaces only an earlier checkpoint of that name; "
        "save to another path, or move it away"
    )


def save(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group=None) -> None:
    """Save ``state_dict`` to directory ``path``; every rank writes only its own shards.

    Collective over ``process_group`` (default: the world, or this process alone
    when torch.distributed is not initialized). Tensors, DTensors (each rank's
    shards), objects with ``state_dict()``/``load_state_dict()``, and plain
    Python values (ints, floats, lists, dicts, bytes, RNG states) are saved.
    ``torch.distributed.checkpoint.load`` reads the result.

    Example::

        hp.checkpoint.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 100}, "ckpt/100")
    """
    _save(state_dict, Path(path), process_group)


class _ReadWhenWritten(DefaultSavePlanner):
    """DCP's save planner, for a state dict some of whose tensors are meta tensors standing for
    whole (plain, unsharded) tensors that are read only when the writer comes to them
    (``loaders``: flattened key -> a callable returning the tensor): a save that need not hold
    them all at once."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self._loaders = loaders

    def resolve_data(self, write_item):
        loader = self._loaders.get(write_item.index.fqn)
        if loader is None:
            return super().resolve_data(write_item)
        if any(write_item.index.offset or ()):
            raise CheckpointError(f"{write_item.index.fqn}: a loader gives a whole tensor, not a shard of one")
        return loader()


def _save(state_dict, path: Path, process_group, on_published=None, loaders=None) -> None:
    _check_state_dict(state_dict)
    group, rank, _ = _group(process_group)
    path = path.absolute()
    staged = _staging(path)
    lock, error = None, None
    if rank == 0:
        try:
            _check_replaceable(path)
            lock = _lock_new_staging(staged, path)
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = f"cannot create {staged}: {e}; check that {path.parent} is writable"
    try:
        _first_error(group, error)
        _write_and_publish(state_dict, path, staged, group, rank, on_published, loaders)
    except BaseException:
        # The error reaches every rank through a collective, so all are done writing.
        if lock is not None:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _write_and_publish(state_dict, path: Path, staged: Path, group, rank: int, on_published, loaders=None) -> None:
    writer = Writer(staged)
    planner = _ReadWhenWritten(loaders) if loaders else None
    try:
        with _quiet(group):
            dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group, no_dist=group is None)
    except CheckpointError:
        raise
    except CheckpointException as e:
        raise _rank_failure(f"saving {path}", e) from None

    files = dict(writer.files)
    if group is not None:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, files, group=group)
        for part in gathered:
            files.update(part)
    error = None
    if rank == 0:
        try:
            size, crc = _C.ckpt_digest_file(str(staged / METADATA), 1)
            files[METADATA] = (size, crc)
            manifest = {"format": 1, "files": {n: {"size": s, "crc32": c} for n, (s, c) in sorted(files.items())}}
            with open(staged / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _C.ckpt_fsync_dir(str(staged))
            if _C.ckpt_publish_dir(str(staged), str(path)):
                shutil.rmtree(staged)  # the previous checkpoint of this name, swapped out
            if on_published is not None:
                on_published(path)
        except (OSError, RuntimeError) as e:
            error = f"publishing {path} failed: {e}"
    _first_error(group, error)


def verify(path: str | os.PathLike, *, process_group=None) -> None:
    """Check every file of checkpoint ``path`` against its recorded size and CRC-32.

    Each rank checks a share of the files; all ranks raise the same
    :class:`CheckpointError` naming the first bad file. Checkpoints written by
    torch.distributed.checkpoint (no ``.checksums.json``) are checked for
    truncation only: every item must lie within its file.
    """
    group, rank, world = _group(process_group)
    path = Path(path)
    error = None
    try:
        error = _verify_share(path, rank, world)
    except Exception as e:  # noqa: BLE001 -- unreadable metadata, I/O errors: reported on every rank
        error = f"checkpoint {path} cannot be read: {e}"
    _first_error(group, error)


def _verify_share(path: Path, rank: int, world: int) -> str | None:
    if not (path / METADATA).is_file():
        if _staging(path).exists():
            return f"checkpoint {path} is incomplete (its save did not finish): load an earlier one"
        return f"{path} is not a checkpoint (no {METADATA}); check the path"
    manifest_path = path / MANIFEST
    if not manifest_path.exists():  # written by torch DCP: check extents against file sizes
        metadata = Reader(path).read_metadata()
        sizes: dict[str, int] = {}
        for info in metadata.storage_data.values():
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        for name, need in sorted(sizes.items()):
            have = (path / name).stat().st_size if (path / name).exists() else -1
            if have < need:
                return f"checkpoint file {path / name} is truncated or missing: {need} bytes expected, {have} found"
        return None
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"checkpoint manifest {manifest_path} is corrupted ({e}); the checkpoint cannot be trusted"
    names = sorted(files)
    resaved = (path / METADATA).stat().st_mtime > manifest_path.stat().st_mtime
    for name in names:
        file = path / name
        if not file.exists():
            return f"checkpoint file {file} is missing"
        if file.stat().st_size != files[name]["size"]:
            if resaved:
                return _resaved(path, manifest_path)
            return (
                f"checkpoint file {file} is truncated or overwritten: {file.stat().st_size} bytes, "
                f"{files[name]['size']} expected; restore it or load an earlier checkpoint"
            )
    mine = [n for i, n in enumerate(names) if i % world == rank or n == METADATA]
    for name in mine:
        _, crc = _C.ckpt_digest_file(str(path / name), io_threads())
        if crc != files[name]["crc32"]:
            if resaved:
                return _resaved(path, manifest_path)
            return (
                f"checkpoint file {path / name} is corrupted: CRC-32 {crc:08x}, {files[name]['crc32']:08x} recorded; "
                "restore it or load an earlier checkpoint"
            )
    return None


def _check_fits(state_dict: dict[str, Any], path: Path) -> None:
    """Checkpoint ``path`` holds every key of ``state_dict`` (flattened as DCP does), each tensor
    with its shape; else a :class:`CheckpointMismatchError` naming them, the same on every rank."""
    saved = Reader(path).read_metadata().state_dict_metadata
    missing, differ = [], []
    for key, value in flatten_state_dict(state_dict)[0].items():
        entry = saved.get(key)
        if entry is None:
            missing.append(key)
        elif isinstance(value, torch.Tensor):
            there = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "not a tensor"
            if there != tuple(value.shape):
                differ.append(f"{key} is {there} there, {tuple(value.shape)} here")
    if missing or differ:
        def first(items: list[str], sep: str) -> str:
            return sep.join(items[:3]) + (f"{sep}..." if len(items) > 3 else "")

        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} keys ({first(missing, ', ')})")
        if differ:
            parts.append(f"{len(differ)} tensors differ in shape ({first(differ, '; ')})")
        raise CheckpointMismatchError(f"checkpoint {path} does not fit the state loaded into it: {' and '.join(parts)}")


def _resaved(path: Path, manifest_path: Path) -> str:
    return (
        f"checkpoint {path}: {METADATA} is newer than {MANIFEST} and does not match it: saved again by "
        f"torch.distributed.checkpoint over an hp.checkpoint? Then delete {manifest_path} to load it without "
        "checksums; else restore it or load an earlier checkpoint"
    )


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group=None) -> None:
    """Load checkpoint ``path`` into ``state_dict`` in place, as torch DCP does.

    The tensors of ``state_dict`` (DTensors: this rank's shards) must already
    have their shapes; the checkpoint may have been saved at any world size or
    mesh (it is resharded on load) or by torch.distributed.checkpoint.save.
    Non-tensor values are replaced in the dict. Files are verified first (see
    :func:`verify`); a corrupted or truncated checkpoint raises
    :class:`CheckpointError` naming the file.

    Example::

        state = {"model": model.state_dict(), "step": 0}
        hp.checkpoint.load(state, "ckpt/100")
        model.load_state_dict(state["model"]); step = state["step"]
    """
    path = Path(path).absolute()
    verify(path, process_group=process_group)
    load_verified(state_dict, path, process_group=process_group)


def load_verified(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group=None) -> None:
    """:func:`load` without verifying the files first: for a checkpoint :func:`verify` has just
    checked, read in parts (``hyperparallel convert`` reads a shard's tensors at a time)."""
    _check_state_dict(state_dict)
    group, _, _ = _group(process_group)
    path = Path(path).absolute()
    _check_fits(state_dict, path)
    try:
        with _quiet(group):
            dcp.load(state_dict, storage_reader=Reader(path), process_group=group, no_dist=group is None)
    except CheckpointError:
        raise
    except CheckpointException as e:
        raise _rank_failure(f"loading {path}", e) from None


def _stage(value):
    """A snapshot of ``value`` in host memory: tensors (DTensor shards included) copied, containers
    copied. A GPU's tensors come to the host here, as torch DCP's async staging brings them: a
    device clone would hold a second state on the GPU while training goes on, and the writer
    thread would read it on a stream of its own, ordered after nothing. This copy runs on the
    caller's stream and is complete when it returns."""
    if isinstance(value, torch.Tensor):  # a DTensor too: a copy of its local shard, under its mesh
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _stage(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_stage(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_stage(v) for v in value)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return _stage(value.state_dict())
    return copy.deepcopy(value)


_async_groups: dict[tuple[int, ...], Any] = {}
# Per group: the last background save started. The next one starts after it, so that every
# rank runs their collectives in the order it called async_save (two at once would interleave).
_async_tails: dict[Any, AsyncSave] = {}
_in_flight: weakref.WeakSet = weakref.WeakSet()  # AsyncSaves not yet waited for
_finish_at_shutdown = False  # _finish_in_flight is registered with hp.comm.shutdown


def _finish_in_flight() -> None:
    """hp.comm.shutdown() (and exit): every asynchronous save finishes before the process goes."""
    global _finish_at_shutdown
    _finish_at_shutdown = False
    for pending in list(_in_flight):
        pending.result()


def _async_group(process_group):
    """A Gloo group with the ranks of ``process_group``, for the background
    save's collectives: training's collectives on the original group go on
    meanwhile without interleaving with them."""
    group, _, _ = _group(process_group)
    if group is None:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _async_groups:
        _async_groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _async_groups[ranks]


class AsyncSave:
    """A save running in the background: :meth:`result` waits for it (and
    raises its error), :meth:`done` says whether it finished."""

    def __init__(self, target, path: Path) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(target,), name=f"hp-ckpt-save {path}", daemon=True)
        global _finish_at_shutdown
        if not _finish_at_shutdown:
            hp_comm._on_shutdown(_finish_in_flight)
            _finish_at_shutdown = True
        _in_flight.add(self)
        self._thread.start()

    def _run(self, target) -> None:
        try:
            target()
        except BaseException as error:  # noqa: BLE001 -- re-raised by result()
            self._error = error

    def done(self) -> bool:
        """True once the checkpoint is published (or the save failed)."""
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the save finished; raise its error if it failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"saving {self.path} is still running after {timeout} s")
        _in_flight.discard(self)
        if self._error is not None:
            raise self._error


def async_save(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group=None) -> AsyncSave:
    """Start saving ``state_dict`` to ``path`` in the background and return at once.

    The state is copied first, into host memory (in the caller, so training
    may change the parameters right after this returns, and a GPU's state
    costs no device memory while it is written); the files are written and published
    by a background thread with the same guarantees as :func:`save`. Every
    rank must call it; call ``.result()`` before relying on the checkpoint.

    Example::

        pending = hp.checkpoint.async_save({"model": model.state_dict()}, "ckpt/200")
        ...  # keep training
        pending.result()
    """
    return _async_save(state_dict, Path(path), process_group)


def _async_save(state_dict, path: Path, process_group, on_published=None) -> AsyncSave:
    """:func:`async_save`; ``on_published(path)`` runs on the coordinator once the checkpoint is published."""
    _check_state_dict(state_dict)
    group = _async_group(process_group)
    snapshot = _stage(state_dict)
    path = path.absolute()
    previous = _async_tails.get(group)

    def after_previous() -> None:
        if previous is not None:
            previous._thread.join()
        _save(snapshot, path, group, on_published)

    _async_tails[group] = pending = AsyncSave(after_previous, path)
    return pending
