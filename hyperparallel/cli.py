"""The ``hyperparallel`` command: a table of subcommands, each a function taking its argv.

Adding a subcommand is one line in ``COMMANDS``: its words and ``"module:function"``
(imported only when that subcommand runs, so ``hyperparallel --help`` is quick).

Example::

    hyperparallel train examples/default.yaml --nproc 2
    hyperparallel data prepare examples/data/stories.txt --out runs/data/stories.bin
    hyperparallel convert to-hf runs/default/checkpoints/step_00000300 runs/hf --config examples/tiny-moe.config.json
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("train",): ("hyperparallel.trainer.run:main", "train a model from a YAML config (docs/train.md)"),
    ("data", "prepare"): ("hyperparallel.trainer.tokenize:prepare_cli", "tokenize text files into a token file"),
    ("convert",): ("hyperparallel.checkpoint.convert:main", "checkpoint <-> HuggingFace model directory"),
}


def _usage() -> str:
    width = max(len(" ".join(words)) for words in COMMANDS)
    rows = "\n".join(f"  {' '.join(words):<{width}}  {help_}" for words, (_, help_) in COMMANDS.items())
    return f"usage: hyperparallel COMMAND [ARGS...]\n\ncommands:\n{rows}\n\n'hyperparallel COMMAND --help' for more"


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to the longest matching subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for words in sorted(COMMANDS, key=len, reverse=True):
        if tuple(argv[: len(words)]) == words:
            target, _ = COMMANDS[words]
            module, _, function = target.partition(":")
            status = getattr(importlib.import_module(module), function)(argv[len(words):])
            return int(status or 0)
    if argv and argv[0] not in ("-h", "--help"):
        known = any(words[0] == argv[0] for words in COMMANDS)
        what = "needs a subcommand" if known and len(argv) == 1 else "is not a command"
        print(f"hyperparallel: {' '.join(argv[:2])!r} {what}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    print(_usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
