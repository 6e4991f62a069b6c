"""``hyperparallel convert``: checkpoint <-> HuggingFace model directory.

``to-hf CKPT OUT --config config.json`` gathers the model tensors of a
checkpoint (any world size it was saved at) in one process and writes an HF
directory: ``config.json``, ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json``, loadable by
``transformers.AutoModelForCausalLM.from_pretrained``. ``from-hf HF_DIR OUT``
writes a checkpoint holding ``{"model": <HF weights>}`` (per-expert Qwen3-MoE
hub weights are fused into the ``experts.gate_up_proj``/``down_proj`` stacks
transformers' modules use). File bytes are written and read by the C++ I/O.

Example::

    python -m hyperparallel.checkpoint.convert to-hf runs/ckpt/step_00001000 hf_out --config config.json
    python -m hyperparallel.checkpoint.convert from-hf hf_out runs/ckpt/step_00000000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
from pathlib import Path

import torch

from hyperparallel import _C
from hyperparallel.checkpoint._api import METADATA, load, save
from hyperparallel.checkpoint._storage import CheckpointError, Reader, io_threads

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
_EXPERT = re.compile(r"^(?P<stack>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}: use e.g. 5GB, 500MB or 1048576")
    return int(float(match.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2)])


def model_tensors(checkpoint: str | os.PathLike, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The full tensors under ``prefix`` of a checkpoint, loaded in this process (keys without the prefix)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / METADATA).is_file():
        raise CheckpointError(f"{checkpoint} is not a checkpoint (no {METADATA}); pass a checkpoint directory")
    metadata = Reader(checkpoint).read_metadata()
    state = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn.startswith(prefix) and hasattr(meta, "size"):
            state[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not state:
        keys = sorted(metadata.state_dict_metadata)[:5]
        raise CheckpointError(
            f"{checkpoint} has no tensors under {prefix!r} (its keys start {keys}); pass --prefix to choose them"
        )
    load(state, checkpoint)
    return {fqn[len(prefix):]: tensor for fqn, tensor in state.items()}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> int:
    """One safetensors file (header, then each tensor's bytes), written by the C++ writer; returns its size."""
    header, entries, offset = {}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {tensor.dtype} has no safetensors code; convert it with --dtype")
        tensor = tensor.detach().cpu().contiguous()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
        entries.append((tensor,))
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    _, size, _ = _C.ckpt_write_file(str(path), [(struct.pack("<Q", len(blob)) + blob,), *entries])
    return size


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, read by the C++ reader."""
    path = str(path)
    (length,) = struct.unpack("<Q", _C.ckpt_read_bytes(path, 0, 8))
    header = json.loads(_C.ckpt_read_bytes(path, 8, length))
    header.pop("__metadata__", None)
    tensors, requests = {}, []
    for name, info in header.items():
        if info["dtype"] not in _FROM_SAFETENSORS:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        tensor = torch.empty(info["shape"], dtype=_FROM_SAFETENSORS[info["dtype"]])
        begin, end = info["data_offsets"]
        if end - begin != tensor.nbytes:
            raise CheckpointError(f"{path}: tensor {name} has {end - begin} bytes for shape {info['shape']}")
        tensors[name] = tensor
        if tensor.nbytes:
            requests.append((path, 8 + length + begin, tensor))
    _C.ckpt_read_into(requests, io_threads())
    return tensors


def to_hf(checkpoint, out, config, *, prefix: str = "model.", max_shard_size: int = 5 << 30,
          dtype: torch.dtype | None = None) -> Path:
    """Write checkpoint's model as an HF directory ``out`` (see the module docstring)."""
    out = Path(out)
    config = Path(config)
    if not config.is_file():
        raise CheckpointError(f"config {config} does not exist: pass the model's HF config.json with --config")
    tensors = model_tensors(checkpoint, prefix)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(shard, out / file)
        weight_map.update({name: file for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copyfile(config, out / "config.json")
    return out


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hub-style per-expert Qwen3-MoE weights -> transformers' stacked gate_up_proj / down_proj."""
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match:
            parts.setdefault(match["stack"], {}).setdefault(match["part"], {})[int(match["expert"])] = tensor
        else:
            out[name] = tensor
    for stack, by_part in parts.items():
        experts = sorted(by_part.get("down_proj", {}))
        try:
            out[f"{stack}.gate_up_proj"] = torch.stack(
                [torch.cat([by_part["gate_proj"][e], by_part["up_proj"][e]]) for e in experts])
            out[f"{stack}.down_proj"] = torch.stack([by_part["down_proj"][e] for e in experts])
        except KeyError as missing:
            raise CheckpointError(f"{stack}: expert weight {missing} is missing from the HF directory") from None
    return out


def from_hf(hf_dir, out, *, prefix: str = "model.") -> Path:
    """Write the weights of HF directory ``hf_dir`` as checkpoint ``out`` ({prefix + name: tensor})."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{hf_dir} has no model.safetensors(.index.json): pass an HF model directory")
    tensors = {}
    for file in files:
        tensors.update(read_safetensors(hf_dir / file))
    tensors = _fuse_experts(tensors)
    nested: dict = {}
    if prefix:
        if not prefix.endswith("."):
            raise CheckpointError(f"--prefix must end with '.', got {prefix!r}")
        nested[prefix[:-1]] = tensors
    else:
        nested = tensors
    save(nested, out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``to-hf CKPT OUT --config config.json`` or ``from-hf HF_DIR OUT``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="hyperparallel convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-hf", help="checkpoint -> HF model directory (safetensors shards + index)")
    to.add_argument("checkpoint")
    to.add_argument("out")
    to.add_argument("--config", required=True, help="the model's HF config.json")
    to.add_argument("--prefix", default="model.", help="key prefix of the model in the checkpoint (default model.)")
    to.add_argument("--max-shard-size", type=_parse_size, default=5 << 30, help="per safetensors file (default 5GB)")
    to.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating-point weights")
    frm = sub.add_parser("from-hf", help="HF model directory -> checkpoint")
    frm.add_argument("hf_dir")
    frm.add_argument("out")
    frm.add_argument("--prefix", default="model.", help="key prefix to store the weights under (default model.)")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-hf":
            to_hf(args.checkpoint, args.out, args.config, prefix=args.prefix, max_shard_size=args.max_shard_size,
                  dtype=getattr(torch, args.dtype) if args.dtype else None)
        else:
            from_hf(args.hf_dir, args.out, prefix=args.prefix)
    except CheckpointError as error:
        print(f"hyperparallel convert: {error}")
        return 1
    print(f"hyperparallel convert: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["from_hf", "main", "model_tensors", "read_safetensors", "to_hf", "write_safetensors"]
