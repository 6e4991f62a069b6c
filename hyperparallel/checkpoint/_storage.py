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


def _contiguous_range(shape, offsets, lengths) -> tuple[int, int] | None:
    """(first element, element count) of a sub-block of a contiguous tensor, if
    the block is one contiguous run of memory."""
    ndim = len(shape)
    d = 0
    while d < ndim and lengths[d] == 1:
        d += 1
    if any(lengths[k] != shape[k] for k in range(d + 1, ndim)):
        return None
    start, stride = 0, 1
    for k in reversed(range(ndim)):
        start += offsets[k] * stride
        stride *= shape[k]
    count = 1
    for n in lengths:
        count *= n
    return start, count


class Reader(FileSystemReader):
    """FileSystemReader whose reads are C++ preads straight into the destination
    tensors (one batch per load), falling back to a staged copy when the
    requested block is not contiguous on one side."""

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
                contiguous = stride == torch.empty(size, device="meta").stride()
                run = _contiguous_range(size, req.storage_offsets, req.lengths) if contiguous else None
                if run is not None and target.dtype == dtype and target.is_contiguous() and target.is_cpu:
                    direct.append((req, target, (path, data_offset + (storage_offset + run[0]) * dtype.itemsize, target)))
                else:
                    staged.append((req, target, path, data_offset, data_size, dtype, storage_offset, size, stride))
            _C.ckpt_read_into([r for _, _, r in direct], io_threads())
            for req, target, _ in direct:
                planner.commit_tensor(req, target)
            for req, target, path, data_offset, data_size, dtype, storage_offset, size, stride in staged:
                storage = torch.empty(data_size, dtype=torch.uint8)
                _C.ckpt_read_into([(path, data_offset, storage)], io_threads())
                saved = storage.view(dtype).as_strided(size, stride, storage_offset)
                for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    saved = saved.narrow(dim, offset, length)
                target.copy_(saved)
                planner.commit_tensor(req, target)
        except RuntimeError as error:
            raise CheckpointError(str(error)) from None
        future: Future = Future()
        future.set_result(None)
        return future
