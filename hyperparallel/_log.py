"""hyperparallel's one logger: diagnostics on stderr, each line prefixed with the rank.

Quiet by default (warnings only); ``HP_LOG=info`` or ``HP_LOG=debug`` shows more::

    HP_LOG=debug torchrun --nproc-per-node 2 train.py
    # [hp rank 1] debug: hp.comm.shutdown: the fabric is closed

What a command prints as its product (``hyperparallel train``'s progress bar,
summary and one-line errors) is output, not logging, and does not come here.
The C++ core does not print; its errors reach Python as exceptions.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def level() -> int:
    """The level ``HP_LOG`` asks for (``warning`` when unset)."""
    name = os.environ.get("HP_LOG", "").strip().lower() or "warning"
    if name not in LEVELS:
        raise ValueError(f"HP_LOG={os.environ['HP_LOG']!r} must be one of {', '.join(LEVELS)}")
    return LEVELS[name]


def _rank() -> str:
    """This process's global rank: torch.distributed's once it runs, torchrun's RANK before."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return os.environ.get("RANK", "0")


class _RankPrefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"[hp rank {_rank()}] {record.levelname.lower()}: {record.getMessage()}" + (
            "\n" + self.formatException(record.exc_info) if record.exc_info else ""
        )


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a message comes (tests and launchers replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _make() -> logging.Logger:
    logger = logging.getLogger("hyperparallel")
    handler = _Stderr()
    handler.setFormatter(_RankPrefix())
    logger.addHandler(handler)
    logger.setLevel(level())
    logger.propagate = False  # one line per message, whatever the application configures
    return logger


log = _make()
