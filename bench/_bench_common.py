"""System-agnostic parts of the side-by-side benchmark (see ``../shared/bench/README.md``).

Everything here is shared by the PyTorch FSDP2 + Muon baseline (``baseline_torch.py``) and the
hyperparallel side, so that "the same model, the same tokens, the same initial weights, the same
optimizer" holds by construction rather than by convention:

* locating the protocol's config files (``../shared/bench`` relative to the repository root by
  default, overridable),
* building ``transformers.Qwen3MoeForCausalLM`` from a ``config.json`` with seeded weights,
* the deterministic synthetic token stream and how it is split over data-parallel ranks,
* the Muon / AdamW parameter split, hyperparameters and learning-rate schedule,
* per-step timing, peak-RSS measurement, rank spawning and the summary JSON,
* the single-process reference run (full tensors, no sharding) that both systems' losses are
  checked against.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import resource
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, muon
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils import logging as hf_logging

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
# Parameters that the protocol keeps on AdamW even though they are matrices.
ADAMW_MATRIX_NAMES = ("embed_tokens", "lm_head")


# --------------------------------------------------------------------------------------------
# What to run
# --------------------------------------------------------------------------------------------


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

    def __post_init__(self) -> None:
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
# Optimizers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimHparams:
    """The protocol's optimizer settings; NS coefficients and eps are ``torch.optim.Muon``'s."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    eps: float = EPS
    adjust_lr_fn: str = "match_rms_adamw"
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 10

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup_steps`` optimizer steps (0-based ``step``), then constant."""
        return self.lr * min(1.0, (step + 1) / self.warmup_steps)

    def muon_defaults(self) -> dict[str, Any]:
        """Keyword arguments in ``torch.optim.Muon``'s spelling."""
        return {
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "ns_coefficients": self.ns_coefficients,
            "eps": self.eps,
            "ns_steps": self.ns_steps,
            "adjust_lr_fn": self.adjust_lr_fn,
        }

    def make_adamw(self, params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=self.lr, betas=self.adamw_betas, weight_decay=self.weight_decay)


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """Muon takes every weight matrix (a >=3-D tensor is a stack of matrices) except the
    embedding and the output head; AdamW takes those and all vectors (norm scales)."""
    return param.ndim >= 2 and not any(part in name for part in ADAMW_MATRIX_NAMES)


def split_params(
    named_params: Iterable[tuple[str, nn.Parameter]],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(muon_params, adamw_params)`` in module order."""
    muon_params: list[nn.Parameter] = []
    adamw_params: list[nn.Parameter] = []
    for name, param in named_params:
        (muon_params if is_muon_param(name, param) else adamw_params).append(param)
    return muon_params, adamw_params


def as_matrices(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensor``'s matrices: one for ``(A, B)``, ``E`` for ``(E, A, B)``.

    They are views (so in-place updates reach ``tensor``) when ``tensor`` is contiguous, which
    parameters and optimizer buffers are; a non-contiguous gradient is only read, so a copy is
    fine there.
    """
    return tensor.reshape(-1, *tensor.shape[-2:]).unbind(0)


class MatrixMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` on full (unsharded) tensors, extended to stacks of matrices.

    ``torch.optim.Muon`` rejects anything but 2-D parameters, while Qwen3-MoE in transformers 5
    stores each layer's experts as 3-D tensors. This hands every expert matrix, as a view into
    the parameter, its gradient and its momentum buffer, to torch's own functional ``muon`` --
    the function ``torch.optim.Muon.step`` calls -- so a 2-D parameter gets bit-for-bit the
    ``torch.optim.Muon`` update and each expert gets the update it would get as a separate
    parameter (including ``adjust_lr_fn`` seeing the expert's own shape).
    """

    def __init__(self, params: Iterable[nn.Parameter], hparams: OptimHparams) -> None:
        super().__init__(params, hparams.muon_defaults())

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                if not param.is_contiguous():
                    raise ValueError("MatrixMuon updates matrices in place: needs contiguous params")
                params.extend(as_matrices(param))
                grads.extend(as_matrices(param.grad))
                bufs.extend(as_matrices(state["momentum_buffer"]))
            muon(
                params,
                grads,
                bufs,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                ns_coefficients=group["ns_coefficients"],
                eps=group["eps"],
                ns_steps=group["ns_steps"],
                adjust_lr_fn=group["adjust_lr_fn"],
                has_complex=False,
            )


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------

PHASES = ("forward", "backward", "optimizer")


@dataclass
class StepRecord:
    """One rank's view of one optimizer step.

    ``phases`` partitions the step's wall time: ``forward``, ``backward`` and ``optimizer`` are
    the compute left in each phase once the time spent blocked in communication is taken out,
    and ``comm_wait`` is that blocked time. ``comm`` breaks ``comm_wait`` down by kind.
    ``cpu_s`` is the CPU time the whole rank process (all its threads) used over the step: on a
    shared machine it shows how much of ``wall_s`` was the rank's own work rather than waiting
    for a core.
    """

    loss: float
    wall_s: float
    cpu_s: float
    phases: dict[str, float]
    comm: dict[str, float]


class StepTimer:
    """Times the phases of a step and the communication waits inside them.

    Wrap each phase in :meth:`phase` and every blocking wait on a collective in :meth:`comm`; a
    wait is charged to the phase it happens in and subtracted from that phase's compute time.
    Waits a system counts itself (``waits``: its cumulative seconds, e.g.
    ``hp.fsdp.comm_wait_seconds``) are charged to each phase by the counter's growth over it.
    """

    def __init__(self, waits: Callable[[], float] | None = None, waits_kind: str = "fabric_wait") -> None:
        self._phase: str | None = None
        self._wall: dict[str, float] = {}
        self._comm: dict[tuple[str, str], float] = defaultdict(float)
        self._cpu_start = 0.0
        self._waits = waits
        self._waits_kind = waits_kind

    def begin_step(self) -> None:
        self._wall.clear()
        self._comm.clear()
        self._cpu_start = time.process_time()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase = name
        start = time.perf_counter()
        waited = self._waits() if self._waits else 0.0
        try:
            yield
        finally:
            self._wall[name] = self._wall.get(name, 0.0) + time.perf_counter() - start
            if self._waits:
                self._comm[(name, self._waits_kind)] += self._waits() - waited
            self._phase = None

    @contextmanager
    def comm(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            # Waits outside a timed phase (set-up, checks) are not part of any step.
            if self._phase is not None:
                self._comm[(self._phase, kind)] += time.perf_counter() - start

    def end_step(self, loss: float) -> StepRecord:
        phases = {
            name: self._wall.get(name, 0.0) - sum(t for (phase, _), t in self._comm.items() if phase == name)
            for name in PHASES
        }
        comm: dict[str, float] = defaultdict(float)
        for (_, kind), seconds in self._comm.items():
            comm[kind] += seconds
        phases["comm_wait"] = sum(comm.values())
        return StepRecord(
            loss=loss,
            wall_s=sum(self._wall.values()),
            cpu_s=time.process_time() - self._cpu_start,
            phases=phases,
            comm=dict(comm),
        )


def train_steps(
    model: nn.Module,
    muon_optimizer: torch.optim.Optimizer,
    adamw_optimizer: torch.optim.Optimizer,
    micro_batches_for_step: Callable[[int], Sequence[torch.Tensor]],
    steps: int,
    hparams: OptimHparams,
    timer: StepTimer,
    sync: Callable[[], None] = lambda: None,
) -> list[StepRecord]:
    """The training loop both systems and the reference share.

    A data-parallel rank passes its one micro-batch per step. The reference may pass several and
    then accumulates ``loss / n`` over them, which reproduces data-parallel gradient averaging
    bit for bit (scaling by a power of two commutes with rounding). The recorded loss is the
    mean of the micro-batch losses. ``sync`` runs untimed before each step (a barrier under data
    parallelism) so every rank's step starts together and per-step times compare across ranks.
    """
    optimizers = (muon_optimizer, adamw_optimizer)
    records = []
    for step in range(steps):
        micro_batches = micro_batches_for_step(step)
        set_lr(optimizers, hparams.lr_at(step))
        sync()
        timer.begin_step()
        losses = []
        for tokens in micro_batches:
            with timer.phase("forward"):
                loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
            with timer.phase("backward"):
                (loss / len(micro_batches)).backward()
            losses.append(loss.item())
        with timer.phase("optimizer"):
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        records.append(timer.end_step(statistics.fmean(losses)))
    return records


def peak_rss_bytes() -> int:
    """This process's peak resident set size as the OS reports it (``VmHWM``)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class RankResult:
    """What a rank sends back to the launching process."""

    steps: list[StepRecord]
    peak_rss_bytes: int
    weights_fingerprint: str


def summarize(system: str, spec: RunSpec, ranks: Sequence[RankResult], **extra: Any) -> dict[str, Any]:
    """The protocol's report for one run of one system.

    A step lasts as long as its slowest rank, so per-step wall time is the maximum over ranks;
    tokens/s divides the global tokens of a step by the median of those times over the steps
    after the first ``SKIP_STEPS``. Phase times and CPU times are averaged over ranks per step,
    then the median over the same steps is taken (so the phases need not add up exactly to the
    median step time). The loss is the mean of the ranks' micro-batch losses, which is the
    global-batch loss because every micro-batch has the same number of tokens.
    """
    fingerprints = {rank.weights_fingerprint for rank in ranks}
    if len(fingerprints) != 1:
        raise RuntimeError(f"ranks started from different weights: {sorted(fingerprints)}")
    num_steps = len(ranks[0].steps)
    walls = [max(rank.steps[i].wall_s for rank in ranks) for i in range(num_steps)]
    losses = [statistics.fmean(rank.steps[i].loss for rank in ranks) for i in range(num_steps)]

    def median_over_steps(get: Callable[[StepRecord], float]) -> float:
        per_step = [statistics.fmean(get(rank.steps[i]) for rank in ranks) for i in range(num_steps)]
        return statistics.median(per_step[SKIP_STEPS:])

    comm_kinds = sorted({kind for rank in ranks for record in rank.steps for kind in record.comm})
    median_step = statistics.median(walls[SKIP_STEPS:])
    rss = [rank.peak_rss_bytes for rank in ranks]
    return {
        "system": system,
        "config": config_name(spec.config_path),
        "steps": spec.steps,
        "world_size": len(ranks),
        "micro_batch": spec.micro_batch,
        "seq_len": spec.seq_len,
        "tokens_per_step": spec.tokens_per_step,
        "tokens_per_s": spec.tokens_per_step / median_step,
        "step_time_median_s": median_step,
        "step_cpu_time_median_s": median_over_steps(lambda r: r.cpu_s),
        "peak_rss_bytes_sum": sum(rss),
        "peak_rss_bytes_per_rank": rss,
        "losses": losses,
        "time_split_s": {
            name: median_over_steps(lambda r, n=name: r.phases[n]) for name in (*PHASES, "comm_wait")
        },
        "comm_split_s": {
            kind: median_over_steps(lambda r, k=kind: r.comm.get(k, 0.0)) for kind in comm_kinds
        },
        "step_times_s": walls,
        "weights_fingerprint": fingerprints.pop(),
        **extra,
    }


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest per-step |a - b| (the protocol's loss-agreement figure)."""
    if len(a) != len(b):
        raise ValueError(f"loss curves differ in length: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------
# Launching ranks
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., RankResult],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # One core per rank: the protocol pins both systems to one intra-op thread.
    torch.set_num_threads(1)
    # The protocol configs keep Qwen's real bos/eos ids, outside the small vocabularies, which
    # makes every rank warn at config load.
    hf_logging.set_verbosity_error()
    result = fn(rank, world_size, *args)
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as out:
        pickle.dump(result, out)


def spawn_ranks(fn: Callable[..., RankResult], nproc: int, *args: Any) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` fresh processes and return their results.

    Each rank is a new interpreter (``spawn``), so its peak RSS is its own, and it gets
    ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` for ``init_process_group("env://")``.
    ``fn`` must be importable by the children (a module-level function). Results travel through
    files rather than a pipe so a large result cannot block a child on a full pipe.
    """
    with tempfile.TemporaryDirectory(prefix="hp-bench-") as out_dir:
        mp.spawn(
            _rank_entry,
            args=(nproc, _free_port(), out_dir, fn, args),
            nprocs=nproc,
            join=True,
        )
        results = []
        for rank in range(nproc):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as result_file:
                results.append(pickle.load(result_file))
        return results


# --------------------------------------------------------------------------------------------
# Single-process reference
# --------------------------------------------------------------------------------------------

REFERENCE_SYSTEM = "reference-single-process"


def _reference_rank(
    rank: int, world_size: int, spec: RunSpec, hparams: OptimHparams, split_like_ranks: bool
) -> RankResult:
    model = build_model(spec.config_path, spec.seed)
    fingerprint = weights_fingerprint(model)
    muon_params, adamw_params = split_params(model.named_parameters())
    tokens = SyntheticTokens(model.config.vocab_size, spec.seq_len, spec.seed)

    def micro_batches(step: int) -> list[torch.Tensor]:
        if split_like_ranks:
            return [tokens.batch(step, spec, dp_rank) for dp_rank in range(spec.nproc)]
        return [tokens.global_batch(step, spec)]

    records = train_steps(
        model,
        MatrixMuon(muon_params, hparams),
        hparams.make_adamw(adamw_params),
        micro_batches,
        spec.steps,
        hparams,
        StepTimer(),
    )
    return RankResult(records, peak_rss_bytes(), fingerprint)


def run_reference(
    spec: RunSpec, hparams: OptimHparams | None = None, *, split_like_ranks: bool = True
) -> dict[str, Any]:
    """Train the same model on the same global batches in one process, without any sharding.

    Initial weights, tokens and optimizer math are those of the distributed runs (full-tensor
    ``torch.optim.Muon`` per matrix, ``torch.optim.AdamW``). With ``split_like_ranks`` the step
    runs forward/backward once per data-parallel rank's micro-batch and accumulates, which gives
    a data-parallel run's gradients exactly, so its losses should match to the last bits. Without
    it the step is one forward over the concatenated global batch: mathematically the same, but
    reductions over 8 instead of 4 sequences round differently, and Muon's bf16 Newton-Schulz
    amplifies that step after step -- the size of ordinary floating-point noise between two
    correct implementations. The timings are one core doing all ranks' work; not comparable.
    """
    results = spawn_ranks(_reference_rank, 1, spec, hparams or OptimHparams(), split_like_ranks)
    batching = "per-rank micro-batches" if split_like_ranks else "global batch"
    return summarize(REFERENCE_SYSTEM, spec, results, batching=batching, data_parallel_ranks=spec.nproc)
