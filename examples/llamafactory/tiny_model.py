"""A tiny Qwen3-MoE HF model directory, made here, to try the LlamaFactory integration offline.

    python examples/llamafactory/tiny_model.py OUT

OUT gets ``config.json`` (examples/tiny-moe.config.json, with the tokenizer's vocabulary),
random weights (seed 0) in safetensors, and a byte-level BPE tokenizer trained on the
instructions and answers of tests/data/alpaca_tiny.json, with Qwen's chat tokens
(``<|im_start|>``, ``<|im_end|>`` as end of sequence, ``<|endoftext|>`` as padding), so that
LlamaFactory's ``qwen3_nothink`` template finds every token it writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer(data: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    texts = [text for example in json.loads(data.read_text()) for text in example.values() if text]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "tiny-moe.config.json")
    parser.add_argument("--data", type=Path, default=ROOT / "tests" / "data" / "alpaca_tiny.json")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary, special tokens included")
    args = parser.parse_args(argv)

    tok = tokenizer(args.data, args.vocab_size)
    config = AutoConfig.from_pretrained(args.config)
    config.vocab_size = len(tok)
    config.pad_token_id, config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)


if __name__ == "__main__":
    main()
