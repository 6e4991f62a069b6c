"""Timing and reporting of the side-by-side benchmark: phases, communication waits, the summary.

The training loop both systems and the reference share, the per-step records each rank sends
back, and the protocol's report of a run (median step after warm-up, time split, peak RSS, the
losses).
"""

from __future__ import annotations

import functools
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from _optim import OptimHparams, set_lr
from _spec import SKIP_STEPS, RunSpec, SyntheticTokens, config_name
from torch import nn

PHASES = ("forward", "backward", "optimizer")


@dataclass
class StepRecord:
    """One rank's view of one optimizer step.

    ``phases`` partitions the step's wall time: ``forward``, ``backward`` and ``optimizer`` are
    the compute left in each phase once the time spent blocked in communication is taken out,
    and ``comm_wait`` is that blocked time. ``comm`` breaks ``comm_wait`` down by kind.
    ``cpu_s`` is the CPU time the whole rank process (all its threads) used over the step: on a
    shared machine it shows how much of ``wall_s`` was the rank's own work rather than waiting
    for a core; ``cpu_phases`` splits it by phase (the same process clock). ``counts`` holds the
    step's work counters (bytes moved, Newton-Schulz matrices; see :class:`StepTimer`).
    """

    loss: float
    wall_s: float
    cpu_s: float
    phases: dict[str, float]
    comm: dict[str, float]
    cpu_phases: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)


class StepTimer:
    """Times the phases of a step and the communication waits inside them.

    Wrap each phase in :meth:`phase` and every blocking wait on a collective in :meth:`comm`; a
    wait is charged to the phase it happens in and subtracted from that phase's compute time.
    Waits a system counts itself (``waits``: its cumulative seconds, e.g.
    ``hp.fsdp.comm_wait_seconds``) are charged to each phase by the counter's growth over it.

    Work counters: :meth:`count` adds to a step's named count (the Gloo wrappers add the bytes
    they move); ``counters`` are a system's own cumulative counters (e.g. hp's fabric bytes), read
    at both ends of each step.
    """

    def __init__(
        self,
        waits: Callable[[], float] | None = None,
        waits_kind: str = "fabric_wait",
        counters: dict[str, Callable[[], float]] | None = None,
    ) -> None:
        self._phase: str | None = None
        self._wall: dict[str, float] = {}
        self._cpu: dict[str, float] = {}
        self._comm: dict[tuple[str, str], float] = defaultdict(float)
        self._counts: dict[str, float] = defaultdict(float)
        self._counters = counters or {}
        self._counter_start: dict[str, float] = {}
        self._cpu_start = 0.0
        self._waits = waits
        self._waits_kind = waits_kind

    def begin_step(self) -> None:
        self._wall.clear()
        self._cpu.clear()
        self._comm.clear()
        self._counts.clear()
        self._counter_start = {name: read() for name, read in self._counters.items()}
        self._cpu_start = time.process_time()

    def count(self, name: str, amount: float) -> None:
        """Adds ``amount`` to this step's count ``name`` (outside a step: dropped, like :meth:`comm`)."""
        if self._phase is not None:
            self._counts[name] += amount

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase = name
        start = time.perf_counter()
        cpu_start = time.process_time()
        waited = self._waits() if self._waits else 0.0
        try:
            yield
        finally:
            self._wall[name] = self._wall.get(name, 0.0) + time.perf_counter() - start
            self._cpu[name] = self._cpu.get(name, 0.0) + time.process_time() - cpu_start
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
            cpu_phases={name: self._cpu.get(name, 0.0) for name in PHASES},
            counts={
                **self._counts,
                **{name: read() - self._counter_start[name] for name, read in self._counters.items()},
            },
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


def train_rank(
    model: nn.Module,
    muon_optimizer: torch.optim.Optimizer,
    adamw_optimizer: torch.optim.Optimizer,
    spec: RunSpec,
    hparams: OptimHparams,
    timer: StepTimer,
    fingerprint: str,
    splits: int = 1,
) -> RankResult:
    """This data-parallel rank's run of ``spec``: its micro-batch of every step, every rank starting
    each step together; its records, peak RSS and the initial weights' fingerprint.

    ``splits`` > 1 accumulates the micro-batch in that many pieces: the same gradient up to the
    order of its fp32 sums (scaling by 1/splits, a power of two, rounds as the whole would).
    """
    rank = dist.get_rank()
    tokens = SyntheticTokens(model.config.vocab_size, spec.seq_len, spec.seed)
    records = train_steps(
        model,
        muon_optimizer,
        adamw_optimizer,
        lambda step: tokens.batch(step, spec, rank).chunk(splits),
        spec.steps,
        hparams,
        timer,
        sync=dist.barrier,
    )
    return RankResult(records, peak_rss_bytes(), fingerprint)


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
    global-batch loss because every micro-batch has the same number of tokens. ``work_per_rank``
    is what a rank does per step (CPU seconds by phase, bytes moved, Newton-Schulz matrices),
    medians over the same steps: comparable where ranks share cores and wall time is not.
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

    count_kinds = sorted({kind for rank in ranks for record in rank.steps for kind in record.counts})
    counts = {kind: median_over_steps(lambda r, k=kind: r.counts.get(k, 0.0)) for kind in count_kinds}
    cpu = {name: median_over_steps(lambda r, n=name: r.cpu_phases.get(n, 0.0)) for name in PHASES}
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
        "precision": spec.precision,
        # What a rank does per step, not how long it takes: comparable when ranks share cores.
        "work_per_rank": {
            "cpu_s": {**cpu, "total": median_over_steps(lambda r: r.cpu_s)},
            "bytes_moved": {
                "gloo": counts.get("gloo_bytes", 0.0),
                "fabric": counts.get("fabric_bytes", 0.0),
                "total": counts.get("gloo_bytes", 0.0) + counts.get("fabric_bytes", 0.0),
            },
            "ns_matrices": counts.get("ns_matrices", 0.0),
            "ns_matrices_by_rank": [
                statistics.median(r.counts.get("ns_matrices", 0.0) for r in rank.steps[SKIP_STEPS:]) for rank in ranks
            ],
        },
        "weights_fingerprint": fingerprints.pop(),
        **extra,
    }


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest per-step |a - b| (the protocol's loss-agreement figure)."""
    if len(a) != len(b):
        raise ValueError(f"loss curves differ in length: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def gpu_lead(ms: float) -> None:
    """Keep the current CUDA stream busy for about ``ms`` (``torch.cuda._sleep``): what the host
    enqueues meanwhile starts once the host is done enqueueing it, so that a timing that follows
    is the GPU's work alone, not the host's launches, and work on several streams starts
    together."""
    torch.cuda._sleep(int(ms * _sleep_cycles_per_ms()))


@functools.cache
def _sleep_cycles_per_ms() -> float:
    # The first sleep also loads its kernel and meets clocks still rising from idle: the
    # second is the one measured.
    cycles = 10_000_000
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / start.elapsed_time(end)


def cuda_event_ms(fn: Callable[[], object], repeats: int = 1, warmup: int = 0, barrier: bool = False,
                  lead_ms: float = 0.0) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream, by CUDA events (the GPU
    benchmarks' one clock). ``barrier``: ranks start each repetition together. ``lead_ms``: the
    clock starts after a :func:`gpu_lead` of that long, so that the host's time to launch
    ``fn``'s work falls outside it (a kernel of tens of microseconds next to its launch)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_ms:
            gpu_lead(lead_ms)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
