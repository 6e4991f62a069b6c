"""Text -> token file (``hyperparallel data prepare``); the format is :mod:`.data`'s.

Text files (documents separated by blank lines) are tokenized with a HuggingFace
``tokenizers`` tokenizer -- a byte-level BPE trained on the text, or a
``tokenizer.json`` from a local directory -- into ``NAME.bin`` (header, then ids),
``NAME.json`` and ``NAME.tokenizer.json``.

Example::

    meta = prepare(["examples/data/stories.txt"], "runs/data/stories.bin", tokenizer="bpe", vocab_size=2048)
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hyperparallel.trainer.config import ConfigError, PrepareConfig, load_config
from hyperparallel.trainer.data import FORMAT, HEADER_BYTES, meta_path, tokenizer_path, write_header

# Documents per encode_batch call while tokenizing (bounds memory for large corpora).
_CHUNK_DOCS = 4096
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


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
    if tokens.suffix == ".json":
        raise ValueError(f"{tokens}: the token file's metadata goes beside it as NAME.json; name it NAME.bin")
    if tokens.exists() and not overwrite:
        raise FileExistsError(f"{tokens} exists; pass --overwrite to replace it")
    if tokenizer == "bpe" and vocab_size < 1:
        raise ValueError(f"a BPE vocabulary needs at least 1 token, got {vocab_size}")
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
    # Every process its own: the nodes of a job on a shared file system may all be making it.
    partial = tokens.with_name(f".{tokens.name}.{socket.gethostname()}.{os.getpid()}.partial")
    count, documents = 0, 0
    with open(partial, "wb") as out:
        out.write(bytes(HEADER_BYTES))  # written for real once the count is known
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
    if count == 0:
        partial.unlink()
        raise ValueError(f"{', '.join(map(str, text))} hold no text: there is nothing to train on")
    meta = {
        "format": FORMAT,
        "dtype": np.dtype(dtype).name,
        "num_tokens": count,
        "num_documents": documents,
        "vocab_size": vocab,
        "eos_id": eos_id,
        "eos_token": eos_token,
        "tokenizer": "bpe (trained on the text)" if tokenizer == "bpe" else str(tokenizer),
        "sources": [str(Path(t)) for t in text],
    }
    with open(partial, "r+b") as out:
        write_header(out, meta)
    # Each file whole or not at all, whichever process (node) renames last.
    tok.save(str(partial.with_suffix(".tokenizer")))
    os.replace(partial.with_suffix(".tokenizer"), tokenizer_path(tokens))
    partial.with_suffix(".meta").write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(partial.with_suffix(".meta"), meta_path(tokens))
    os.replace(partial, tokens)  # last: the token file exists only when complete
    return meta


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

    prep, out = PrepareConfig(), args.out
    if args.config:
        try:
            cfg = load_config(args.config)
        except ConfigError as error:
            print(f"hyperparallel data prepare: {error}", file=sys.stderr)
            return 2
        prep, out = cfg.data.prepare, out or cfg.data.tokens
    text = args.text or prep.text
    if not text or not out:
        parser.error("give text files and --out, or --config with data.prepare.text and data.tokens")
    try:
        meta = prepare(
            text, out,
            tokenizer=args.tokenizer or prep.tokenizer,
            vocab_size=prep.vocab_size if args.vocab_size is None else args.vocab_size,
            eos_token=args.eos_token or prep.eos_token,
            overwrite=args.overwrite,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as error:
        print(f"hyperparallel data prepare: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {meta['num_tokens']:,} tokens ({meta['dtype']}), {meta['num_documents']:,} documents, "
          f"vocabulary {meta['vocab_size']:,}; tokenizer {tokenizer_path(out)}")
    return 0
