"""What a run shows and leaves behind: progress bar, metrics.jsonl, loss plot, summary."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
PHASES = ("data", "forward", "backward", "optimizer", "comm_wait")


class Phases:
    """Wall time per phase of a step; waits on other ranks (hp.fsdp.comm_wait_seconds) are
    taken out of the phase they happened in and counted as ``comm_wait``. On a GPU each phase
    ends when the work it queued is done (a synchronize), so that its time is its own."""

    def __init__(self, device: torch.device) -> None:
        from hyperparallel.fsdp import comm_wait_seconds

        self._waits = comm_wait_seconds
        self._device = device if device.type == "cuda" else None
        self.times = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        self.times = dict.fromkeys(PHASES, 0.0)

    def run(self, name: str, fn, *args):
        start, waited = time.perf_counter(), self._waits()
        result = fn(*args)
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        wait = self._waits() - waited
        self.times[name] += time.perf_counter() - start - wait
        self.times["comm_wait"] += wait
        return result


def summarize(run: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's summary: ``run`` (what it knows of the run) and what every rank measured.

    ``ranks[r]`` holds rank r's ``peak_rss_bytes``, ``peak_device_bytes`` (the device memory
    it allocated at its peak, torch's and hyperparallel's, without the CUDA context; 0 on
    the CPU) and ``per_step`` (its phase times per step). A step takes as long
    as its slowest rank (the others wait for it); phases are means over ranks. The first
    step is left out when there are more than 3: it builds plans and touches memory.
    """
    steps = len(ranks[0]["per_step"])
    kept = range(1 if steps > 3 else 0, steps)
    split = {name: statistics.fmean(statistics.fmean(r["per_step"][i][name] for r in ranks) for i in kept)
             if steps else 0.0 for name in PHASES}
    walls = [max(r["per_step"][i]["step_s"] for r in ranks) for i in kept]
    step_median = statistics.median(walls) if walls else 0.0
    split["other"] = max(0.0, (statistics.fmean(walls) if walls else 0.0) - sum(split.values()))
    return {
        **run,
        "tokens_per_s": run["global_batch"] * run["seq_len"] / step_median if step_median else 0.0,
        "step_s_median": step_median,
        "time_split_s": split,
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_device_bytes_per_rank": [r["peak_device_bytes"] for r in ranks],
    }


def human(n: float, unit: str = "") -> str:
    """``1234567`` -> ``1.23M``: three significant digits and an SI suffix."""
    for suffix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}{unit}" if suffix or n != int(n) else f"{int(n)}{unit}"
        n /= 1000
    return f"{n:.3g}P{unit}"


def duration(seconds: float) -> str:
    """``135.6`` -> ``2:16`` (``h:mm:ss`` from an hour)."""
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A one-line progress bar on stderr (a line every ``every`` steps when stderr is not a terminal).

    The bar runs to ``total`` (the schedule's steps); the time left and the last line are
    this run's, which ends at ``stop`` (``train.stop_at``, or ``total``)."""

    def __init__(self, total: int, start: int, stop: int, every: int, enabled: bool) -> None:
        self.total, self.start, self.stop, self.every, self.enabled = total, start, stop, every, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last = start

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        """Show that ``step`` (1-based) finished."""
        if not self.enabled:
            return
        self.last = step
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.stop - step) if done else 0.0
        frac = step / self.total
        bar = ("=" * int(24 * frac)).ljust(24)
        line = (f"step {step}/{self.total} [{bar}] {100 * frac:3.0f}% | loss {loss:.4f} | lr {lr:.2e} | "
                f"{human(tokens_per_s)} tok/s | {duration(elapsed)}<{duration(eta)}")
        if self.tty:
            sys.stderr.write("\r" + line + "\x1b[K")
            if step == self.stop:
                sys.stderr.write("\n")
        elif step % self.every == 0 or step == self.stop or done == 1:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.last != self.stop:  # ended early: end the bar's line
            sys.stderr.write("\n")


class Metrics:
    """Appends one JSON object per step to ``metrics.jsonl`` (rank 0)."""

    def __init__(self, path: Path, keep_until: int) -> None:
        self.path = path
        if path.exists():  # resuming: drop steps after the checkpoint, they are redone
            kept = []
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # blank, or cut short by a crash while it was written
                if record.get("step", 0) <= keep_until:
                    kept.append(line)
            path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a")  # noqa: SIM115 (kept open for the run)

    def write(self, record: dict[str, Any]) -> None:
        """Append one step's record (flushed, so a crash loses nothing written)."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(metrics_path: Path, out: Path) -> Path:
    """Loss and tokens/s against step, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1.2)
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.set_title(f"hyperparallel train: {metrics_path.parent.name}")
    ax_tps.plot(steps, [r["tokens_per_s"] for r in records], lw=1.0, color="tab:green")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summary_text(summary: dict[str, Any]) -> str:
    """The one-screen summary printed at the end of a run."""
    s = summary
    split = s["time_split_s"]
    total = sum(split.values()) or 1.0
    parts = " | ".join(f"{name.replace('_', ' ')} {100 * t / total:.0f}%" for name, t in split.items())
    rss = ", ".join(f"{r / MIB:.0f}" for r in s["peak_rss_bytes_per_rank"])
    est = s.get("estimate_bytes_per_rank")
    est_text = f" (dry-run estimate {est / MIB:.0f} MiB)" if est else ""
    memory = f"peak RSS per rank (MiB): {rss}{est_text}"
    if s["device"] == "cuda":
        gpu = ", ".join(f"{r / MIB:.0f}" for r in s["peak_device_bytes_per_rank"])
        memory = (f"peak GPU memory per rank (MiB): {gpu}, without the CUDA context{est_text}; "
                  f"peak RSS (MiB): {rss}")
    p = s["params"]
    lines = [
        (f"hyperparallel train: {s['steps_run']} steps in {duration(s['wall_s'])}, "
         f"{human(s['tokens'])} tokens, {human(s['tokens_per_s'])} tokens/s (median step {s['step_s_median']:.3f} s)"),
        (f"  model    {s['model']}: {human(p['total'])} params ({human(p['active'])} active per token), "
         f"{s['world_size']} ranks ({s['device']}), {s['optimizer']}, {s['precision']}, "
         f"patch {'on' if s['patch'] else 'off'}, activation checkpointing {'on' if s['activation_checkpointing'] else 'off'}"),
        (f"  batch    {s['global_batch']} x {s['seq_len']} tokens per step = {s['micro_batch']} per rank x "
         f"{s['accumulation']} micro-batches x {s['world_size']} ranks"),
        f"  loss     {s['first_loss']:.4f} (step {s['first_step']}) -> {s['last_loss']:.4f} (step {s['last_step']})",
        f"  memory   {memory}",
        f"  time     {parts}  (per step, mean over ranks)",
        (f"  outputs  {s['output_dir']}: metrics.jsonl, summary.json"
         + (", loss.png" if s.get("plot") else "")
         + (f", {s['checkpoint']}" if s.get("checkpoint") else "")),
    ]
    return "\n".join(lines)
