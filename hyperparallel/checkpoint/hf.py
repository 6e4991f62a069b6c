"""HuggingFace model directories: the one place that knows their files and tensor names.

An HF directory holds ``config.json`` and either ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. Hub checkpoints keep one
tensor per expert (``...experts.<e>.{gate,up,down}_proj.weight``, what
``save_pretrained`` writes); transformers 5.x models stack them into
``experts.gate_up_proj`` (each expert's gate rows, then its up rows) and
``experts.down_proj``. Safetensors bytes are read and written by the C++ I/O.
``hp.nn.load_pretrained`` and ``hyperparallel convert`` both go through here.

Example::

    from hyperparallel.checkpoint import hf

    reader = hf.DirectoryReader("ckpt/")  # per-expert weights read as gate_up_proj / down_proj stacks
    stacked = {name: reader.read(name) for name in reader.names}
    hf.write_directory(stacked, "out/", config="ckpt/config.json")
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from hyperparallel import _C
from hyperparallel.checkpoint._storage import CheckpointError, io_threads

INDEX = "model.safetensors.index.json"
# The weight files transformers loads from a directory: what write_directory removes from a
# directory it writes into, lest an old one be loaded instead of the new shards.
_WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
                      r"|pytorch_model(-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index\.json")
SINGLE = "model.safetensors"

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

_PER_EXPERT = re.compile(r"^(?P<stack>.+\.experts)\.(?P<index>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")

# A stacked expert tensor's name (after "<stack>.") and the per-expert parts it holds, in row order.
STACKED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def has_safetensors(directory: str | os.PathLike) -> bool:
    """Whether HF directory ``directory`` holds its weights as safetensors (``model.safetensors`` or the index)."""
    return (Path(directory) / INDEX).is_file() or (Path(directory) / SINGLE).is_file()


def shard_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of HF directory ``directory``: the index's shards, or ``model.safetensors``."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / SINGLE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory} has neither {SINGLE} nor {INDEX}: pass an HF model directory")


class SafetensorsFile:
    """One safetensors file: its header, read once; tensors are read on demand by the C++ reader.

    Example::

        file = SafetensorsFile("ckpt/model.safetensors")
        for name in file.names:
            tensor = file.read([name])[name]
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        size = os.path.getsize(self.path)
        if size < 8:
            raise CheckpointError(f"{self.path} is not a safetensors file (it has {size} bytes); check the file")
        (length,) = struct.unpack("<Q", _C.ckpt_read_bytes(self.path, 0, 8))
        if length > size - 8:
            raise CheckpointError(
                f"{self.path} is not a safetensors file (its first 8 bytes give a header of {length} bytes, "
                f"longer than the file's {size}); check the file"
            )
        try:
            header = json.loads(_C.ckpt_read_bytes(self.path, 8, length))
        except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
            header = None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path} is not a safetensors file (its header is not a JSON object); "
                                  "check the file")
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        self._entries = header
        self.names = list(header)
        for name, info in header.items():
            offsets = info.get("data_offsets") if isinstance(info, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                    and isinstance(info.get("shape"), list) and isinstance(info.get("dtype"), str)):
                raise CheckpointError(f"{self.path} is not a safetensors file (tensor {name}'s header entry is "
                                      f"{info!r}); check the file")
        end = max((info["data_offsets"][1] for info in header.values()), default=0)
        if self._data_start + end > size:
            raise CheckpointError(f"{self.path} is truncated: its header places tensors up to byte "
                                  f"{self._data_start + end}, the file has {size}; download or save it again")

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, from the header (nothing is read)."""
        return tuple(self._entries[name]["shape"])

    def _located(self, name: str) -> tuple[torch.dtype, list[int], int]:
        """Tensor ``name``'s dtype, shape and first byte in the file, its entry checked against its bytes."""
        info = self._entries[name]
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype, shape = _DTYPES[info["dtype"]], info["shape"]
        begin, end = info["data_offsets"]
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        if end - begin != nbytes:
            raise CheckpointError(f"{self.path}: tensor {name} has {end - begin} bytes for shape {shape}")
        return dtype, shape, self._data_start + begin

    def dtype(self, name: str) -> torch.dtype:
        """Tensor ``name``'s dtype, from the header (nothing is read)."""
        return self._located(name)[0]

    def request(self, name: str, target: torch.Tensor) -> tuple[str, int, torch.Tensor]:
        """The C++ reader's request (``_C.ckpt_read_into``) that reads tensor ``name`` into
        ``target``, a contiguous CPU tensor of its dtype and shape (a view into a larger one
        will do)."""
        dtype, shape, start = self._located(name)
        if target.dtype != dtype or list(target.shape) != shape or not target.is_contiguous():
            raise CheckpointError(f"{self.path}: tensor {name} ({dtype}, {shape}) cannot be read into a "
                                  f"{'' if target.is_contiguous() else 'non-contiguous '}{target.dtype} "
                                  f"tensor of shape {list(target.shape)}")
        return self.path, start, target

    def read(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (default: all), in new CPU tensors, read with ``HP_CKPT_THREADS`` threads."""
        tensors, requests = {}, []
        for name in self.names if names is None else names:
            tensors[name] = tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
            if tensor.nbytes:
                requests.append(self.request(name, tensor))
        _C.ckpt_read_into(requests, io_threads())
        return tensors

    def read_rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        """Rows ``begin:end`` (along dim 0) of tensor ``name``: only their bytes are read, as a
        rank does for its shard of a parameter."""
        dtype, shape, start = self._located(name)
        if not shape or not 0 <= begin <= end <= shape[0]:
            raise ValueError(f"{self.path}: tensor {name} of shape {shape} has no rows {begin}:{end}")
        tensor = torch.empty([end - begin, *shape[1:]], dtype=dtype)
        if tensor.nbytes:
            _C.ckpt_read_into([(self.path, start + begin * (tensor.nbytes // (end - begin)), tensor)], io_threads())
        return tensor


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, read by the C++ reader."""
    return SafetensorsFile(path).read()


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> int:
    """One safetensors file (header, then each tensor's bytes), written by the C++ writer; returns its size."""
    header, entries, offset = {}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_CODES:
            raise CheckpointError(f"{name}: dtype {tensor.dtype} has no safetensors code; convert it with --dtype")
        tensor = tensor.detach().cpu().contiguous()
        header[name] = {"dtype": _DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
        entries.append((tensor,))
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    file = _C.CkptFileWriter(str(path))
    file.append([(struct.pack("<Q", len(blob)) + blob,), *entries])
    size, _ = file.finish()
    return size


def write_directory(tensors: dict[str, torch.Tensor], out: str | os.PathLike, config: str | os.PathLike,
                    max_shard_size: int = 5 << 30) -> Path:
    """An HF directory ``out`` holding ``tensors`` (see :class:`DirectoryWriter`, which writes it)."""
    writer = DirectoryWriter(out, config, {name: tensor.nbytes for name, tensor in tensors.items()}, max_shard_size)
    for names in writer.shards:
        writer.write({name: tensors[name] for name in names})
    return writer.close()


def shard_plan(sizes: dict[str, int], max_shard_size: int = 5 << 30) -> list[list[str]]:
    """The names of each safetensors shard of an HF directory holding tensors of ``sizes`` (name ->
    bytes, in order): at most ``max_shard_size`` bytes each, a larger tensor in a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


class DirectoryWriter:
    """An HF directory ``out`` written one safetensors shard at a time, so a model need never be
    whole in memory: only the shard being written.

    ``sizes`` (name -> bytes, in the order to write) plans the shards up front
    (:func:`shard_plan`): ``model-0000i-of-0000n.safetensors``; :attr:`shards` lists each one's
    names. Hand each shard's tensors to
    :meth:`write` in turn, then :meth:`close` writes the index and copies ``config`` to
    ``config.json``. Weight files already in ``out`` (``model.safetensors``, other shards,
    ``pytorch_model*.bin``) are removed once the new ones are written; its other files stay.

    Example::

        writer = hf.DirectoryWriter("out/", "ckpt/config.json", {n: t.nbytes for n, t in state.items()})
        for names in writer.shards:
            writer.write({n: state[n].full_tensor() for n in names})
        writer.close()
    """

    def __init__(self, out: str | os.PathLike, config: str | os.PathLike, sizes: dict[str, int],
                 max_shard_size: int = 5 << 30) -> None:
        self.out, self.config, self.sizes = Path(out), Path(config), dict(sizes)
        self.shards = shard_plan(self.sizes, max_shard_size)
        self.out.mkdir(parents=True, exist_ok=True)
        self._stale = [old for old in self.out.iterdir() if _WEIGHTS.fullmatch(old.name) and old.is_file()]
        self._written = 0
        self._weight_map: dict[str, str] = {}

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """The next shard, ``{name: tensor}`` for the names :attr:`shards` lists for it."""
        if self._written == len(self.shards):
            raise CheckpointError(f"{self.out}: all {len(self.shards)} shards are written already")
        names = self.shards[self._written]
        if list(tensors) != names:
            raise CheckpointError(f"{self.out}: shard {self._written + 1} holds {names[:3]}..., given "
                                  f"{list(tensors)[:3]}...: write the shards in the planned order")
        for name, tensor in tensors.items():
            if tensor.nbytes != self.sizes[name]:
                raise CheckpointError(f"{name}: {tensor.nbytes} bytes, {self.sizes[name]} planned")
        self._written += 1
        file = f"model-{self._written:05d}-of-{len(self.shards):05d}.safetensors"
        write_safetensors(tensors, self.out / file)
        self._weight_map.update(dict.fromkeys(names, file))

    def close(self) -> Path:
        """The index and ``config.json`` once every shard is written; the stale weight files removed."""
        if self._written != len(self.shards):
            raise CheckpointError(f"{self.out}: {self._written} of {len(self.shards)} shards written; the directory "
                                  "is incomplete")
        index = {"metadata": {"total_size": sum(self.sizes.values())},
                 "weight_map": dict(sorted(self._weight_map.items()))}
        (self.out / INDEX).write_text(json.dumps(index, indent=2))
        for old in self._stale:  # once the new weights are all there
            if old.name not in self._weight_map.values() and old.name != INDEX:
                old.unlink()
        if not (self.out / "config.json").exists() or not os.path.samefile(self.config, self.out / "config.json"):
            shutil.copyfile(self.config, self.out / "config.json")
        return self.out


class ExpertKey(NamedTuple):
    """A per-expert tensor name, taken apart: ``<stack>.<index>.<part>.weight``."""

    stack: str  # "...mlp.experts"
    index: int
    part: str  # gate_proj, up_proj or down_proj

    @property
    def stacked(self) -> str:
        """The name of the stacked tensor this expert's part belongs to."""
        return f"{self.stack}.{'down_proj' if self.part == 'down_proj' else 'gate_up_proj'}"


def expert_key(name: str) -> ExpertKey | None:
    """``name`` taken apart if it is a per-expert tensor's name, else None."""
    match = _PER_EXPERT.match(name)
    return ExpertKey(match["stack"], int(match["index"]), match["part"]) if match else None


def expert_rows(stacked: torch.Tensor, key: ExpertKey) -> torch.Tensor:
    """The view of stacked tensor ``stacked`` (``key.stacked``) where expert ``key.index``'s ``key.part`` lies."""
    if key.part == "down_proj":
        return stacked[key.index]
    rows = stacked.shape[1] // 2
    return stacked[key.index, :rows] if key.part == "gate_proj" else stacked[key.index, rows:]


class DirectoryReader:
    """The tensors of an HF directory under the names transformers 5.x models give them
    (per-expert weights stacked into ``experts.gate_up_proj`` / ``experts.down_proj``), each
    read when asked for: only the safetensors headers are read up front, so a reader of the
    whole model need hold one tensor of it at a time.

    Example::

        reader = hf.DirectoryReader("ckpt/")
        for name in reader.names:
            print(name, reader.shape(name), reader.dtype(name))  # from the headers
            tensor = reader.read(name)  # the stacks filled straight from each expert's bytes
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self._sources: dict[str, list[tuple[ExpertKey | None, SafetensorsFile, str]]] = {}
        parts: dict[str, dict[ExpertKey, tuple[SafetensorsFile, str]]] = {}
        for path in shard_files(directory):
            file = SafetensorsFile(path)
            for name in file.names:
                key = expert_key(name)
                if key is None:
                    self._sources[name] = [(None, file, name)]
                else:
                    parts.setdefault(key.stacked, {})[key] = (file, name)
        self._meta = {name: (file.shape(source), file.dtype(source))
                      for name, [(_, file, source)] in self._sources.items()}
        for stacked, by_key in parts.items():
            first = next(iter(by_key))
            experts = 1 + max(key.index for key in by_key)
            wanted = [first._replace(index=e, part=part)
                      for e in range(experts) for part in STACKED_PARTS[stacked.rsplit(".", 1)[1]]]
            missing = [key for key in wanted if key not in by_key]
            if missing:
                key = missing[0]
                raise CheckpointError(f"{key.stack}: expert weight {key.index}.{key.part} is missing from the HF directory")
            shapes = {(by_key[key][0].shape(by_key[key][1]), by_key[key][0].dtype(by_key[key][1])) for key in wanted}
            if len(shapes) > 1:
                raise CheckpointError(f"{stacked}: its experts' weights differ in shape or dtype ({sorted(map(str, shapes))}); "
                                      "check the HF directory")
            (row_shape, dtype), = shapes
            rows = row_shape[0] * len(wanted) // experts
            self._meta[stacked] = ((experts, rows, *row_shape[1:]), dtype)
            self._sources[stacked] = [(key, *by_key[key]) for key in wanted]
        self.names = list(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape (nothing is read)."""
        return tuple(self._meta[name][0])

    def dtype(self, name: str) -> torch.dtype:
        """Tensor ``name``'s dtype (nothing is read)."""
        return self._meta[name][1]

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in a new CPU tensor; a stack's experts read straight into their rows."""
        tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
        requests = [file.request(source, tensor if key is None else expert_rows(tensor, key))
                    for key, file, source in self._sources[name]]
        _C.ckpt_read_into([request for request in requests if request[2].nbytes], io_threads())
        return tensor


__all__ = [
    "INDEX",
    "SINGLE",
    "STACKED_PARTS",
    "DirectoryReader",
    "DirectoryWriter",
    "ExpertKey",
    "SafetensorsFile",
    "expert_key",
    "expert_rows",
    "has_safetensors",
    "read_safetensors",
    "shard_files",
    "shard_plan",
    "write_directory",
    "write_safetensors",
]
