"""``hyperparallel convert``: checkpoint <-> HuggingFace model directory.

``to-hf CKPT OUT --config config.json`` gathers the model tensors of a
checkpoint (any world size it was saved at) in one process, one safetensors
shard's at a time, and writes an HF directory: ``config.json``,
``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json``, loadable by
``transformers.AutoModelForCausalLM.from_pretrained``. ``from-hf HF_DIR OUT``
writes a checkpoint holding ``{"model": <HF weights>}`` (per-expert Qwen3-MoE
hub weights are stacked into the ``experts.gate_up_proj``/``down_proj`` tensors
transformers' modules use), reading each tensor as the writer comes to it.
HF directory I/O is :mod:`hyperparallel.checkpoint.hf`'s.

Example::

    python -m hyperparallel.checkpoint.convert to-hf runs/ckpt/step_00001000 hf_out --config config.json
    python -m hyperparallel.checkpoint.convert from-hf hf_out runs/ckpt/step_00000000
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from pathlib import Path

import torch

from hyperparallel.checkpoint import hf
from hyperparallel.checkpoint._api import METADATA, _save, load_verified, verify
from hyperparallel.checkpoint._storage import CheckpointError, Reader
from hyperparallel.checkpoint.hf import read_safetensors, write_safetensors  # also this module's API


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}: use e.g. 5GB, 500MB or 1048576")
    return int(float(match.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2)])


def _model_entries(checkpoint: Path, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The shape and dtype of each tensor under ``prefix`` in the checkpoint's metadata (keys without the prefix)."""
    if not (checkpoint / METADATA).is_file():
        raise CheckpointError(f"{checkpoint} is not a checkpoint (no {METADATA}); pass a checkpoint directory")
    metadata = Reader(checkpoint).read_metadata()
    entries = {fqn[len(prefix):]: (meta.size, meta.properties.dtype)
               for fqn, meta in metadata.state_dict_metadata.items() if fqn.startswith(prefix) and hasattr(meta, "size")}
    if not entries:
        keys = sorted(metadata.state_dict_metadata)[:5]
        raise CheckpointError(
            f"{checkpoint} has no tensors under {prefix!r} (its keys start {keys}); pass --prefix to choose them"
        )
    return entries


def to_hf(checkpoint, out, config, *, prefix: str = "model.", max_shard_size: int = 5 << 30,
          dtype: torch.dtype | None = None) -> Path:
    """Write checkpoint's model as an HF directory ``out`` (see the module docstring). The files
    are verified once, then each safetensors shard's tensors are read and written in turn: the
    model is never whole in memory, only one shard (``max_shard_size``)."""
    config = Path(config)
    if not config.is_file():
        raise CheckpointError(f"config {config} does not exist: pass the model's HF config.json with --config")
    checkpoint = Path(checkpoint)
    entries = _model_entries(checkpoint, prefix)

    def cast(tensor_dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and tensor_dtype.is_floating_point else tensor_dtype

    sizes = {name: math.prod(size) * cast(tensor_dtype).itemsize for name, (size, tensor_dtype) in entries.items()}
    verify(checkpoint)
    writer = hf.DirectoryWriter(out, config, sizes, max_shard_size)
    for names in writer.shards:
        state = {prefix + name: torch.empty(entries[name][0], dtype=entries[name][1]) for name in names}
        load_verified(state, checkpoint)
        writer.write({name: state[prefix + name].to(cast(entries[name][1])) for name in names})
    return writer.close()


def from_hf(hf_dir, out, *, prefix: str = "model.") -> Path:
    """Write the weights of HF directory ``hf_dir`` as checkpoint ``out`` ({prefix + name: tensor}).
    Each tensor is read as the writer comes to it (``STAGE_BYTES`` at a time): the model is never
    whole in memory."""
    if prefix and not prefix.endswith("."):
        raise CheckpointError(f"--prefix must end with '.', got {prefix!r}")
    reader = hf.DirectoryReader(hf_dir)
    sources = {name: name for name in reader.names}
    # A model whose head is its embedding saves the embedding only; its state_dict() (which a
    # load fills) has both names.
    if (Path(hf_dir) / "config.json").is_file() and "lm_head.weight" not in sources:
        from transformers import AutoConfig

        embedding = next((name for name in sources if name.endswith("embed_tokens.weight")), None)
        if embedding is not None and AutoConfig.from_pretrained(hf_dir).tie_word_embeddings:
            sources["lm_head.weight"] = embedding
    tensors = {name: torch.empty(reader.shape(source), dtype=reader.dtype(source), device="meta")
               for name, source in sources.items()}
    loaders = {prefix + name: functools.partial(reader.read, source) for name, source in sources.items()}
    _save({prefix[:-1]: tensors} if prefix else tensors, Path(out), None, loaders=loaders)
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
    except (CheckpointError, OSError, RuntimeError) as error:  # RuntimeError: the C++ reader's I/O errors
        print(f"hyperparallel convert: {error}")
        return 1
    print(f"hyperparallel convert: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["from_hf", "main", "read_safetensors", "to_hf", "write_safetensors"]
