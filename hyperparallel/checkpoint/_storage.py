"""DCP storage layer whose byte I/O runs in C++ (csrc/checkpoint).

:class:`Writer` and :class:`Reader` are torch.distributed.checkpoint's
FileSystemWriter/Reader with ``write_data``/``read_data`` replaced: the
planning, metadata and on-disk layout (``.metadata`` + ``__<rank>_0.distcp``,
each tensor item a torch.save archive) are DCP's own, so either side reads
the other's checkpoints.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
import warnings
import zipfile
from functools import cache

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from hyperparallel import _C


class CheckpointError(Exception):
    """A checkpoint could not be written or read: the message names the file or
    key at fault and what to do about it."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint is sound but does not fit the state loaded into it: keys it lacks, or
    tensors of other shapes (another model, optimizer or configuration)."""


def io_threads() -> int:
    """Threads per rank reading and verifying checkpoint files (``HP_CKPT_THREADS``, default 4)."""
    return max(1, int(os.environ.get("HP_CKPT_THREADS", "4")))


@cache
def storage_type(dtype: torch.dtype) -> str:
    """The storage class name torch.save pickles for ``dtype`` ("FloatStorage", ...)."""
    buffer = io.BytesIO()
    torch.save(torch.empty(0, dtype=dtype), buffer)
    pkl = zipfile.ZipFile(buffer).read("archive/data.pkl")
    return re.search(rb"ctorch\n(\w+)\n", pkl).group(1).decode()


@cache
def _dtype_of(storage_name: str) -> torch.dtype:
    """dtype of a pickled storage class name: "FloatStorage" or, for newer dtypes, the dtype's name."""
    obj = getattr(torch, storage_name, None)
    if isinstance(obj, torch.dtype):
        return obj
    with warnings.catch_warnings():  # the legacy storage classes are deprecated, but name the dtypes
        warnings.simplefilter("ignore")
        dtype = getattr(obj, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise CheckpointError(f"unknown tensor storage type {storage_name!r} in a checkpoint item")


class _TensorRecord(tuple):
    """(storage key, dtype, storage offset, size, stride) of a pickled tensor."""


def _record(key, dtype_name: str, storage_offset, size, stride, metadata) -> _TensorRecord:
    if metadata and (metadata.get("conj") or metadata.get("neg")):
        # torch.save kept a lazily conjugated (or negated) view's storage as it is.
        raise CheckpointError(
            "a checkpoint item is a conjugated or negated view saved unresolved, which hp.checkpoint does not "
            "read; save tensor.resolve_conj().resolve_neg() instead"
        )
    return _TensorRecord((key, _dtype_of(dtype_name), storage_offset, tuple(size), tuple(stride)))


def _rebuild(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None, *rest):
    """``_rebuild_tensor_v2``: a typed storage, whose class name says the dtype."""
    _, name, key, _, _ = storage
    return _record(key, name, storage_offset, size, stride, metadata)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None, *rest):
    """``_rebuild_tensor_v3``: torch's pickle of the dtypes without a typed storage (float8s,
    uint16/32/64), an UntypedStorage and the dtype's name after it."""
    _, _, key, _, _ = storage
    return _record(key, dtype, storage_offset, size, stride, metadata)


class _TensorPickle(pickle.Unpickler):
    """Reads what torch.save pickled for a tensor without touching its data."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return name
        if module == "torch":
            return name  # a storage class: its name says the dtype
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise CheckpointError(f"unsupported object {module}.{name} in a checkpoint tensor item")

    def persistent_load(self, pid):
        return pid


# How many bytes of items a rank's Writer gathers before it writes them: a save
# holds this much beyond what its state already holds (the CPU copies of GPU
# shards, tensors a lazy save reads), whatever its size.
STAGE_BYTES = 256 << 20


def _entry(planner, wi) -> tuple:
    """The C++ writer's item for write item ``wi``: (bytes,) or (tensor, storage type)."""
    data = planner.resolve_data(wi)
    if wi.type == WriteItemType.BYTE_IO:
        return (data.getvalue(),)
    # The values, not a lazy conjugate's (or negative's) storage: the pickle has no flag.
    tensor = data.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return tensor, storage_type(tensor.dtype)


def _written(call, *args):
    """``call(*args)``, its I/O errors (the C++ writer's RuntimeError) as CheckpointError."""
    try:
        return call(*args)
    except RuntimeError as error:
        raise CheckpointError(str(error)) from None


class Writer(FileSystemWriter):
    """FileSystemWriter writing each rank's items to one file with C++ pwrites,
    :data:`STAGE_BYTES` of them at a time.

    ``files`` maps each file written by this rank to (size, crc32).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.files: dict[str, tuple[int, int]] = {}

    def write_data(self, plan, planner):
        file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        items = [wi for wi in plan.items if wi.type == WriteItemType.BYTE_IO]
        items += [wi for wi in plan.items if wi.type != WriteItemType.BYTE_IO]
        extents: list = []
        file = _written(_C.CkptFileWriter, os.path.join(self.path, file_name))
        entries, staged = [], 0
        for position, wi in enumerate(items):
            entry = _entry(planner, wi)
            staged += entry[0].nbytes if isinstance(entry[0], torch.Tensor) else len(entry[0])
            entries.append(entry)
            del entry  # the batch holds it; no name keeps it past the batch's append
            if staged >= STAGE_BYTES or position == len(items) - 1:
                extents += _written(file.append, entries)
                entries, staged = [], 0
        self.files[file_name] = _written(file.finish)
        results = [
            WriteResult(index=wi.index, size_in_bytes=length, storage_data=_StorageInfo(file_name, offset, length))
            for wi, (offset, length) in zip(items, extents)
        ]
        future: Future = Future()
        future.set_result(results)
        return future


def _span(stride, storage_offset: int, offsets, lengths) -> tuple[int, int]:
    """(first element, element count) of the shortest run of a saved tensor's storage
    that holds its block at ``offsets`` of ``lengths``: a load reads that run, never the
    whole item (a shard of a resharded load, a GPU's block staged on the host)."""
    if 0 in lengths:
        return storage_offset, 0
    first = storage_offset + sum(o * s for o, s in zip(offsets, stride))
    return first, sum((n - 1) * s for n, s in zip(lengths, stride)) + 1


class Reader(FileSystemReader):
    """FileSystemReader whose reads are C++ preads straight into the destination
    tensors (one batch per load) where the requested block is one run of memory on
    both sides; otherwise the run holding the block is read into host memory (pinned
    for a GPU's tensor) and copied from there."""

    def read_data(self, plan, planner):
        direct, staged = [], []
        try:
            for req in plan.items:
                info: _StorageInfo = self.storage_data[req.storage_index]
                if info.transform_descriptors:
                    raise CheckpointError(
                        f"{self.path}/{info.relative_path}: items written with stream transforms "
                        f"{list(info.transform_descriptors)} are not supported; save without _extensions"
                    )
                path = os.path.join(self.path, info.relative_path)
                if req.type == LoadItemType.BYTE_IO:
                    data = _C.ckpt_read_bytes(path, info.offset, info.length)
                    planner.load_bytes(req, io.BytesIO(data))
                    continue
                records = _C.ckpt_records(path, info.offset, info.length)
                pkl_offset, pkl_size, _ = records["data.pkl"]
                key, dtype, storage_offset, size, stride = _TensorPickle(
                    io.BytesIO(_C.ckpt_read_bytes(path, pkl_offset, pkl_size))
                ).load()
                data_offset, data_size, _ = records[f"data/{key}"]
                target = planner.resolve_tensor(req).detach()
                if tuple(target.shape) != tuple(req.lengths):
                    raise CheckpointError(
                        f"{req.storage_index.fqn}: the checkpoint holds a block of shape {tuple(req.lengths)} "
                        f"for a destination of shape {tuple(target.shape)}"
                    )
                first, count = _span(stride, storage_offset, req.storage_offsets, req.lengths)
                if (first + count) * dtype.itemsize > data_size:
                    raise CheckpointError(
                        f"{path}: {req.storage_index.fqn}'s block ends at byte {(first + count) * dtype.itemsize} "
                        f"of a record of {data_size} bytes: the file is corrupt; save it again"
                    )
                read = (path, data_offset + first * dtype.itemsize)
                if count == 0:
                    planner.commit_tensor(req, target)
                elif (count == target.numel() and stride == torch.empty(size, device="meta").stride()
                        and target.dtype == dtype and target.is_contiguous() and target.is_cpu):
                    direct.append((req, target, (*read, target)))
                else:
                    staged.append((req, target, read, dtype, count, stride))
            _C.ckpt_read_into([r for _, _, r in direct], io_threads())
            for req, target, _ in direct:
                planner.commit_tensor(req, target)
            for req, target, read, dtype, count, stride in staged:
                run = torch.empty(count * dtype.itemsize, dtype=torch.uint8, pin_memory=target.is_cuda)
                _C.ckpt_read_into([(*read, run)], io_threads())
                target.copy_(run.view(dtype).as_strided(req.lengths, stride))
                planner.commit_tensor(req, target)
        except RuntimeError as error:
            raise CheckpointError(str(error)) from None
        future: Future = Future()
        future.set_result(None)
        return future
