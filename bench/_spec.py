"""What a side-by-side benchmark run is (see ``../shared/bench/README.md``), and how its ranks start.

Shared by the PyTorch FSDP2 + Muon baseline (``baseline_torch.py``), the hyperparallel side and
the single-process reference, so that "the same model, the same tokens, the same initial
weights" holds by construction rather than by convention:

* locating the protocol's config files (``../shared/bench`` relative to the repository root by
  default, overridable),
* building ``transformers.Qwen3MoeForCausalLM`` from a ``config.json`` with seeded weights,
* the deterministic synthetic token stream and how it is split over data-parallel ranks,
* starting a run's ranks (``hyperparallel.launch.run``, one thread each).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils import logging as hf_logging

from hyperparallel.launch import run

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR_ENV = "HYPERPARALLEL_BENCH_DIR"
# The README lives in the shared checkout next to the repository: ``<repo>/../shared/bench``.
DEFAULT_BENCH_DIR = REPO_ROOT.parent / "shared" / "bench"
DEFAULT_CONFIG = "qwen3-moe-small"
CONFIG_SUFFIX = ".config.json"
# The README fixes the sequence length per model; anything else runs at the bench length.
PROTOCOL_SEQ_LEN = {"qwen3-moe-small": 256, "qwen3-moe-bench": 512}
DEFAULT_SEQ_LEN = 512
# tokens/s and the time split are medians over the steps after these warm-up steps.
SKIP_STEPS = 3
PRECISIONS = ("fp32", "bf16")


def bench_dir() -> Path:
    """The directory holding the protocol's config files (``$HYPERPARALLEL_BENCH_DIR`` wins)."""
    return Path(os.environ.get(BENCH_DIR_ENV, DEFAULT_BENCH_DIR))


def resolve_config(name_or_path: str | os.PathLike[str], directory: Path | None = None) -> Path:
    """Return the config file for an explicit path, or for a bare protocol name such as
    ``qwen3-moe-small`` / ``qwen3-moe-small.config.json`` looked up in ``directory``."""
    path = Path(name_or_path)
    if path.is_file():
        return path.resolve()
    directory = directory if directory is not None else bench_dir()
    for candidate in (directory / path.name, directory / f"{path.name}{CONFIG_SUFFIX}"):
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"no config {name_or_path!r} (also looked in {directory})")


def config_name(config_path: Path) -> str:
    """``.../qwen3-moe-small.config.json`` -> ``qwen3-moe-small``."""
    return config_path.name.removesuffix(CONFIG_SUFFIX).removesuffix(".json")


@dataclass(frozen=True)
class RunSpec:
    """One benchmark run; identical for both systems so that their results are comparable."""

    config_path: Path
    steps: int = 10
    nproc: int = 2
    micro_batch: int = 4
    seq_len: int = DEFAULT_SEQ_LEN
    seed: int = 0
    # "fp32", or "bf16": bf16 compute copies of the parameters, fp32 gradient reduction, fp32
    # master weights and optimizer state (FSDP2's MixedPrecisionPolicy, for every system).
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.steps <= SKIP_STEPS:
            raise ValueError(f"need more than {SKIP_STEPS} steps: the first {SKIP_STEPS} are warm-up")
        if min(self.nproc, self.micro_batch, self.seq_len) < 1:
            raise ValueError("nproc, micro_batch and seq_len must be positive")

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks (no accumulation)."""
        return self.nproc * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def mp_policy(self) -> MixedPrecisionPolicy:
        """The ``mp_policy`` every ``fully_shard`` call of the run takes (torch's and hp's)."""
        if self.precision == "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The command-line options every system of the benchmark accepts."""
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="config.json path, or a protocol model name looked up in --bench-dir",
    )
    parser.add_argument(
        "--bench-dir",
        type=Path,
        default=None,
        help=f"protocol directory (default: ${BENCH_DIR_ENV} or {DEFAULT_BENCH_DIR})",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel world size")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="default: 256 for qwen3-moe-small, 512 otherwise (the protocol's lengths)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and token-stream seed")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="fp32",
        help="bf16: bf16 parameters in forward/backward, fp32 reduction, fp32 master weights",
    )


def run_spec_from_args(args: argparse.Namespace) -> RunSpec:
    config_path = resolve_config(args.config, args.bench_dir)
    seq_len = args.seq_len or PROTOCOL_SEQ_LEN.get(config_name(config_path), DEFAULT_SEQ_LEN)
    return RunSpec(
        config_path=config_path,
        steps=args.steps,
        nproc=args.nproc,
        micro_batch=args.micro_batch,
        seq_len=seq_len,
        seed=args.seed,
        precision=args.precision,
    )


# --------------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------------


def load_model_config(config_path: Path) -> Qwen3MoeConfig:
    """The ``Qwen3MoeConfig`` of ``config_path``, set up for training (no KV cache)."""
    config = Qwen3MoeConfig.from_json_file(str(config_path))
    config.use_cache = False
    return config


def build_model(config_path: Path, seed: int) -> Qwen3MoeForCausalLM:
    """``Qwen3MoeForCausalLM`` in fp32 with weights that depend on ``seed`` only.

    Every rank calls this with the same seed instead of broadcasting from rank 0, so no
    communication is needed and each system can shard however it likes afterwards; equality is
    checked with :func:`weights_fingerprint`. Stock HF modules with their CPU-fastest kernels:
    SDPA attention and the ``grouped_mm`` experts path (both HF's defaults; measured fastest
    here: eager attention and eager experts are slower, ``batched_mm`` tens of times slower).
    """
    config = load_model_config(config_path)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM._from_config(
        config,
        attn_implementation="sdpa",
        experts_implementation="grouped_mm",
        dtype=torch.float32,
    )
    return model.train()


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 over every parameter's name and exact bytes: equal iff the weights are bitwise equal."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, stable across processes (unlike ``hash()`` of strings)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


class SyntheticTokens:
    """A deterministic, download-free token stream with something to learn.

    Uniform random tokens would pin the loss at ln(vocab), so the stream is a random sparse bigram
    chain: every token has ``branching`` fixed successors drawn with Zipf-like probabilities, and
    each sequence starts from a uniform token. Sequence ``k`` of the stream depends only on
    ``(seed, k)``; step ``s`` consumes sequences ``[s * G, (s + 1) * G)`` for global batch ``G``
    and data-parallel rank ``r`` gets the ``r``-th block of ``micro_batch`` of them. So a rank
    generates only its own rows, and the concatenation over ranks is exactly the single-process
    reference's batch.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, branching: int = 8) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        table_rng = torch.Generator().manual_seed(derive_seed(seed, "bigram-table"))
        self._successors = torch.randint(vocab_size, (vocab_size, branching), generator=table_rng)
        weights = 1.0 / torch.arange(1, branching + 1, dtype=torch.float32)
        self._branch_probs = weights / weights.sum()

    def sequences(self, start: int, count: int) -> torch.Tensor:
        """Sequences ``[start, start + count)`` of the stream, int64 of shape ``(count, seq_len)``."""
        firsts, branches = [], []
        for index in range(start, start + count):
            rng = torch.Generator().manual_seed(derive_seed(self.seed, "sequence", index))
            firsts.append(torch.randint(self.vocab_size, (1,), generator=rng))
            branches.append(
                torch.multinomial(self._branch_probs, self.seq_len - 1, replacement=True, generator=rng)
            )
        branch = torch.stack(branches)
        tokens = torch.empty(count, self.seq_len, dtype=torch.long)
        tokens[:, 0] = torch.cat(firsts)
        # The chain is sequential in time but vectorised over the sequences of the batch.
        for t in range(1, self.seq_len):
            tokens[:, t] = self._successors[tokens[:, t - 1], branch[:, t - 1]]
        return tokens

    def batch(self, step: int, spec: RunSpec, rank: int) -> torch.Tensor:
        """Data-parallel rank ``rank``'s micro-batch at optimizer step ``step``."""
        return self.sequences(step * spec.global_batch + rank * spec.micro_batch, spec.micro_batch)

    def global_batch(self, step: int, spec: RunSpec) -> torch.Tensor:
        """All ranks' micro-batches of step ``step``, concatenated in rank order."""
        return self.sequences(step * spec.global_batch, spec.global_batch)


# --------------------------------------------------------------------------------------------
# Launching ranks
# --------------------------------------------------------------------------------------------


def _rank_main(fn: Callable[..., Any], *args: Any) -> Any:
    # One core per rank: the protocol pins both systems to one intra-op thread.
    torch.set_num_threads(1)
    # The protocol configs keep Qwen's real bos/eos ids, outside the small vocabularies, which
    # makes every rank warn at config load.
    hf_logging.set_verbosity_error()
    return fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)


def spawn_ranks(fn: Callable[..., Any], nproc: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` ranks; their results in rank order.

    The ranks start through ``hyperparallel.launch.run`` (torch's launcher): each a new
    interpreter, so its peak RSS is its own, with torchrun's environment for
    ``init_process_group("env://")`` or ``hp.comm.init()``. ``fn`` must be importable by the
    ranks (a module-level function).
    """
    results = run(_rank_main, nproc, args=(fn, *args))
    return [results[rank] for rank in range(nproc)]
