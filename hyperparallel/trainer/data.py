"""Token files: text -> one memory-mapped array of token ids, and the loader that reads it.

``prepare`` tokenizes text files (documents separated by blank lines) with a
HuggingFace ``tokenizers`` tokenizer -- a byte-level BPE trained on the text,
or a ``tokenizer.json`` from a local directory -- and writes, side by side:

- ``NAME.bin``: every document's ids followed by the end-of-sequence id, as
  one flat uint16 (vocabularies up to 65536) or uint32 array;
- ``NAME.json``: dtype, token count, vocabulary size, eos id, sources;
- ``NAME.tokenizer.json``: the tokenizer, to decode samples later.

:class:`TokenLoader` cuts the stream into ``seq_len``-token samples, orders
them by a per-epoch permutation of a seed, and hands each data-parallel rank
its rows of each global batch. A batch depends only on (seed, position), so a
run resumes at the exact sample, and the global batch is the same whatever the
world size.

Example::

    meta = prepare(["examples/data/stories.txt"], "runs/data/stories.bin", tokenizer="bpe", vocab_size=2048)
    loader = TokenLoader("runs/data/stories.bin", seq_len=256, global_batch=16, micro_batch=4,
                         dp_rank=0, dp_size=2, seed=0)
    ids = loader.micro_batch(0)        # [4, 256] int64, this rank's first micro-batch of step 0
    loader.advance()                   # next step
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Documents per encode_batch call while tokenizing (bounds memory for large corpora).
_CHUNK_DOCS = 4096
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def meta_path(tokens: str | os.PathLike) -> Path:
    """``NAME.json`` beside ``NAME.bin``: the token file's metadata."""
    return Path(tokens).with_suffix(".json")


def tokenizer_path(tokens: str | os.PathLike) -> Path:
    """``NAME.tokenizer.json`` beside ``NAME.bin``: the tokenizer that made it."""
    return Path(tokens).with_suffix(".tokenizer.json")


def read_meta(tokens: str | os.PathLike) -> dict[str, Any]:
    """The metadata written beside a token file."""
    path = meta_path(tokens)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {tokens} was not made by `hyperparallel data prepare`")
    return json.loads(path.read_text())


def _documents(files: list[str]):
    for name in files:
        text = Path(name).read_text(encoding="utf-8", errors="replace")
        for doc in text.split("\n\n"):
            doc = doc.strip()
            if doc:
                yield doc


def _train_bpe(files: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<|endoftext|>"],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_documents(files), trainer=trainer)
    return tokenizer, "<|endoftext|>"


def _load_tokenizer(spec: str):
    from tokenizers import Tokenizer

    path = Path(spec)
    directory = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: give a directory holding an HF tokenizer.json, or the file")
    tokenizer = Tokenizer.from_file(str(file))
    eos = None
    config = directory / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("eos_token")
        eos = value.get("content") if isinstance(value, dict) else value
    if eos is None:
        eos = next((name for name in _EOS_NAMES if tokenizer.token_to_id(name) is not None), None)
    return tokenizer, eos


def _with_eos(encodings, eos_id: int, dtype) -> np.ndarray:
    """The documents' ids, each followed by eos_id, as one array (no loop over tokens)."""
    pieces = [np.asarray(e.ids, dtype=dtype) for e in encodings]
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    out = np.empty(int(lengths.sum()) + len(pieces), dtype=dtype)
    eos_at = np.cumsum(lengths + 1) - 1
    keep = np.ones(len(out), dtype=bool)
    keep[eos_at] = False
    out[eos_at] = eos_id
    if pieces:
        out[keep] = np.concatenate(pieces)
    return out


def prepare(
    text: list[str],
    tokens: str | os.PathLike,
    *,
    tokenizer: str = "bpe",
    vocab_size: int = 2048,
    eos_token: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize ``text`` files into the token file ``tokens`` (see the module docstring); return its metadata.

    Raises FileExistsError if ``tokens`` exists and ``overwrite`` is false.
    """
    tokens = Path(tokens)
    if tokens.exists() and not overwrite:
        raise FileExistsError(f"{tokens} exists; pass --overwrite to replace it")
    for name in text:
        if not Path(name).is_file():
            raise FileNotFoundError(f"text file {name} does not exist")
    if not text:
        raise ValueError("no text files to tokenize")
    if tokenizer == "bpe":
        tok, default_eos = _train_bpe(text, vocab_size)
    else:
        tok, default_eos = _load_tokenizer(tokenizer)
    eos_token = eos_token or default_eos
    eos_id = tok.token_to_id(eos_token) if eos_token else None
    if eos_id is None:
        raise ValueError(
            f"the tokenizer has no end-of-sequence token {eos_token!r}; set data.prepare.eos_token "
            "(or --eos-token) to one of its tokens"
        )
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    tokens.parent.mkdir(parents=True, exist_ok=True)
    partial = tokens.with_name(tokens.name + ".partial")
    count, documents = 0, 0
    with open(partial, "wb") as out:
        batch: list[str] = []
        for doc in _documents(text):
            batch.append(doc)
            if len(batch) == _CHUNK_DOCS:
                ids = _with_eos(tok.encode_batch(batch), eos_id, dtype)
                out.write(ids.tobytes())
                count, documents, batch = count + len(ids), documents + len(batch), []
        if batch:
            ids = _with_eos(tok.encode_batch(batch), eos_id, dtype)
            out.write(ids.tobytes())
            count, documents = count + len(ids), documents + len(batch)
    meta = {
        "format": "hyperparallel-tokens-v1",
        "dtype": np.dtype(dtype).name,
        "num_tokens": count,
        "num_documents": documents,
        "vocab_size": vocab,
        "eos_id": eos_id,
        "eos_token": eos_token,
        "tokenizer": "bpe (trained on the text)" if tokenizer == "bpe" else str(tokenizer),
        "sources": [str(Path(t)) for t in text],
    }
    tok.save(str(tokenizer_path(tokens)))
    meta_path(tokens).write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(partial, tokens)  # last: the token file exists only when complete
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
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
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


def prepare_cli(argv: list[str]) -> int:
    """``hyperparallel data prepare``: text files -> token file."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="hyperparallel data prepare",
        description="Tokenize text files (documents separated by blank lines) into a memory-mapped token file.",
    )
    parser.add_argument("text", nargs="*", help="text files (or give a config with data.prepare.text)")
    parser.add_argument("--out", help="the token file to write (NAME.bin); default: the config's data.tokens")
    parser.add_argument("--config", help="take text, out and tokenizer settings from this training config")
    parser.add_argument("--tokenizer", default=None,
                        help="'bpe' (train on the text; the default) or a directory / tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default 2048)")
    parser.add_argument("--eos-token", default=None, help="end-of-document token (default: the tokenizer's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing token file")
    args = parser.parse_args(argv)
    from hyperparallel.trainer.config import PrepareConfig, load_config

    prep, out = PrepareConfig(), args.out
    if args.config:
        cfg = load_config(args.config)
        prep, out = cfg.data.prepare, out or cfg.data.tokens
    text = args.text or prep.text
    if not text or not out:
        parser.error("give text files and --out, or --config with data.prepare.text and data.tokens")
    try:
        meta = prepare(
            text, out,
            tokenizer=args.tokenizer or prep.tokenizer,
            vocab_size=args.vocab_size or prep.vocab_size,
            eos_token=args.eos_token or prep.eos_token,
            overwrite=args.overwrite,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as error:
        print(f"hyperparallel data prepare: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {meta['num_tokens']:,} tokens ({meta['dtype']}), {meta['num_documents']:,} documents, "
          f"vocabulary {meta['vocab_size']:,}; tokenizer {tokenizer_path(out)}")
    return 0


def remove(tokens: str | os.PathLike) -> None:
    """Delete a token file and what was written beside it."""
    for path in (Path(tokens), meta_path(tokens), tokenizer_path(tokens)):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
