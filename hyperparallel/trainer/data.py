"""Token files: their format, how one is checked, and the loader that reads it.

A token file (made by ``hyperparallel data prepare``, see :mod:`.tokenize`) is, side by side:

- ``NAME.bin``: a 64-byte header (``HPTOKENS``, format version, bytes per id, token
  count, vocabulary size, end-of-sequence id; little-endian), then every document's ids
  followed by the end-of-sequence id, as one flat uint16 (vocabularies up to 65536) or
  uint32 array;
- ``NAME.json``: the same numbers, the tokenizer and the sources, for people;
- ``NAME.tokenizer.json``: the tokenizer, to decode samples later.

:func:`read_meta` refuses, naming the file and the fix, anything else: a file of another
origin, one whose header and ``.json`` disagree, a truncated or overlong one.

:class:`TokenLoader` cuts the stream into ``seq_len``-token samples, orders
them by a per-epoch permutation of a seed, and hands each data-parallel rank
its rows of each global batch. A batch depends only on (seed, position), so a
run resumes at the exact sample, and the global batch is the same whatever the
world size.

Example::

    loader = TokenLoader("runs/data/stories.bin", seq_len=256, global_batch=16, micro_batch=4,
                         dp_rank=0, dp_size=2, seed=0)
    ids = loader.micro_batch(0)        # [4, 256] int64, this rank's first micro-batch of step 0
    loader.advance()                   # next step
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

FORMAT = "hyperparallel-tokens-v2"
HEADER_BYTES = 64
_MAGIC = b"HPTOKENS"
_VERSION = 2
# magic, version, bytes per id, tokens, vocabulary, eos id; zero-padded to HEADER_BYTES.
_HEADER = struct.Struct("<8sIIQQQ")
_MAKE = "make it with `hyperparallel data prepare` (or list text files in data.prepare.text)"
_REMAKE = ("make it again with `hyperparallel data prepare --overwrite` (or delete it and list text files in "
           "data.prepare.text)")


class TokenFileError(ValueError):
    """A token file that cannot be trained on; the message names the file and the fix."""


def meta_path(tokens: str | os.PathLike) -> Path:
    """``NAME.json`` beside ``NAME.bin``: the token file's metadata."""
    return Path(tokens).with_suffix(".json")


def tokenizer_path(tokens: str | os.PathLike) -> Path:
    """``NAME.tokenizer.json`` beside ``NAME.bin``: the tokenizer that made it."""
    return Path(tokens).with_suffix(".tokenizer.json")


def write_header(file: BinaryIO, meta: dict[str, Any]) -> None:
    """The header of a token file with metadata ``meta``, at the file's start."""
    header = _HEADER.pack(_MAGIC, _VERSION, np.dtype(meta["dtype"]).itemsize, meta["num_tokens"],
                          meta["vocab_size"], meta["eos_id"])
    file.seek(0)
    file.write(header.ljust(HEADER_BYTES, b"\0"))


def read_meta(tokens: str | os.PathLike) -> dict[str, Any]:
    """The metadata of token file ``tokens``, once its header and size are checked against it.

    Raises :class:`TokenFileError` naming the problem and the fix.
    """
    tokens, path = Path(tokens), meta_path(tokens)
    if not tokens.is_file():
        raise TokenFileError(f"{tokens} does not exist; {_MAKE}")
    if not path.is_file():
        raise TokenFileError(f"{tokens} has no metadata ({path.name} is missing beside it), so it is not a token "
                             f"file; {_REMAKE}")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise TokenFileError(f"{tokens}: its metadata {path.name} is not JSON ({error}); {_REMAKE}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise TokenFileError(f"{tokens}: its metadata {path.name} is of format {found!r}, not {FORMAT!r}; "
                             f"{_REMAKE}")
    with open(tokens, "rb") as file:
        raw = file.read(_HEADER.size)
    if len(raw) < _HEADER.size or not raw.startswith(_MAGIC):
        raise TokenFileError(f"{tokens} has no token file header (it does not start with {_MAGIC.decode()}), "
                             f"so it is not a token file; {_REMAKE}")
    _, version, itemsize, count, vocab, eos = _HEADER.unpack(raw)
    said = (version, itemsize, count, vocab, eos)
    expected = (_VERSION, np.dtype(meta["dtype"]).itemsize, meta["num_tokens"], meta["vocab_size"], meta["eos_id"])
    if said != expected:
        raise TokenFileError(f"{tokens}: its header (version, bytes per id, tokens, vocabulary, eos) = {said} "
                             f"disagrees with {path.name}'s {expected}: they are from different runs; {_REMAKE}")
    size, need = tokens.stat().st_size, HEADER_BYTES + count * itemsize
    if size != need:
        raise TokenFileError(f"{tokens} is {size} bytes where its header says {need} ({count} tokens): it is "
                             f"truncated or was overwritten; {_REMAKE}")
    return meta


class TokenLoader:
    """Samples of ``seq_len`` tokens from a token file, split over data-parallel ranks.

    Sample ``k`` is tokens ``[k*seq_len, (k+1)*seq_len)``. The stream of samples is the
    concatenation of epochs, each a permutation of all samples drawn from ``(seed, epoch)``.
    A step consumes ``global_batch`` consecutive samples of the stream; within them, micro-batch
    ``m`` of rank ``r`` is the block ``(m * dp_size + r) * micro_batch`` onwards. ``position``
    (samples consumed) is the whole state: :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        meta = read_meta(path)
        self.path = Path(path)
        self.meta = meta
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", offset=HEADER_BYTES)
        self.seq_len = seq_len
        self.num_samples = len(self.tokens) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"{path} holds {len(self.tokens)} tokens, fewer than one sample of {seq_len}")
        self.global_batch = global_batch
        self.micro_batch_size = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.position = 0
        self._perms: dict[int, np.ndarray] = {}
        self._offsets = np.arange(seq_len, dtype=np.int64)

    @property
    def epoch(self) -> float:
        """Passes over the file so far (fractional)."""
        return self.position / self.num_samples

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perms[epoch]

    def samples(self, start: int, count: int) -> np.ndarray:
        """Sample indices of stream positions ``[start, start+count)``."""
        stream = np.arange(start, start + count, dtype=np.int64)
        epochs, within = np.divmod(stream, self.num_samples)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # one or two epochs per batch
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[within[sel]]
        return out

    def micro_batch(self, index: int) -> torch.Tensor:
        """This rank's ``index``-th micro-batch of the current step: int64 ``[micro_batch, seq_len]``."""
        start = self.position + (index * self.dp_size + self.dp_rank) * self.micro_batch_size
        rows = self.samples(start, self.micro_batch_size)
        ids = self.tokens[rows[:, None] * self.seq_len + self._offsets]
        return torch.from_numpy(ids.astype(np.int64))

    def advance(self) -> None:
        """Move to the next step's global batch."""
        self.position += self.global_batch

    def state_dict(self) -> dict[str, Any]:
        """The position, with what must match to resume at it."""
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position; the file, seed and seq_len must be the same."""
        for key in ("seed", "seq_len", "num_samples"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data loader had {key}={state[key]}, this run has {getattr(self, key)}: "
                    "resuming at the exact sample needs the same token file, data.seq_len and data.seed"
                )
        self.position = int(state["position"])
