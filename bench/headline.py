"""The headline: hyperparallel FSDP + Muon vs PyTorch FSDP2 + Muon, side by side.

    python bench/headline.py                                  # qwen3-moe-small, 10 steps
    python bench/headline.py --config qwen3-moe-bench --steps 30

Follows ../shared/bench/README.md: the same seeded Qwen3-MoE, the same token stream split over
2 ranks the same way, one thread per rank, Muon for the weight matrices and AdamW for the rest
with the protocol's settings. hyperparallel runs hp.nn.patch + hp.fully_shard + hp.optim.Muon;
the baseline is bench/baseline_torch.py (stock HF modules, torch's fully_shard, Gloo, every rank
gathering every full gradient for torch.optim.Muon's Newton-Schulz). The baseline gets its best
settings: its first round tries reshard_after_forward true and false and keeps the faster
(`--baseline-reshard true|false` fixes it, to save time once the faster is known).
Systems alternate (hp, torch, hp, torch, ...) in one invocation. Prints one JSON line per system
(tokens/s from the median step after the first 3, peak RSS summed over ranks, per-step losses,
time split), then the ratios; writes a PNG with both loss curves and the time split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _optim import OptimHparams, optimizers
from _spec import (
    add_run_args,
    build_model,
    run_spec_from_args,
    spawn_ranks,
    weights_fingerprint,
)
from _timing import RankResult, StepTimer, max_abs_diff, summarize, train_rank
from baseline_torch import run_baseline

import hyperparallel as hp

SYSTEM = "hyperparallel"


def _hp_rank(rank: int, world_size: int, spec, hparams: OptimHparams) -> RankResult:
    hp.comm.init()
    model = build_model(spec.config_path, spec.seed)
    fingerprint = weights_fingerprint(model)
    hp.nn.patch(model)
    for layer in model.model.layers:
        hp.fully_shard(layer)
    hp.fully_shard(model)
    muon, adamw = optimizers(model, hparams, lambda params: hp.optim.Muon(params, **hparams.muon_defaults()))
    return train_rank(model, muon, adamw, spec, hparams, StepTimer(waits=hp.fsdp.comm_wait_seconds), fingerprint)


def run_hp(spec, hparams: OptimHparams | None = None) -> dict:
    return summarize(SYSTEM, spec, spawn_ranks(_hp_rank, spec.nproc, spec, hparams or OptimHparams()))


def _plot(path: Path, ours: dict, theirs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, split) = plt.subplots(1, 2, figsize=(11, 4))
    for report in (ours, theirs):
        curves.plot(range(1, len(report["losses"]) + 1), report["losses"], label=report["system"])
    curves.set(xlabel="step", ylabel="loss", title="loss (same tokens, same initial weights)")
    curves.legend()
    phases = ["forward", "backward", "optimizer", "comm_wait"]
    bottom = [0.0, 0.0]
    for phase in phases:
        heights = [ours["time_split_s"][phase], theirs["time_split_s"][phase]]
        split.bar([ours["system"], theirs["system"]], heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    split.set(ylabel="seconds per step (median)", title="where a step goes")
    split.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(parser)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two systems")
    parser.add_argument("--plot", type=Path, default=Path("headline.png"), help="where to save the PNG")
    parser.add_argument(
        "--baseline-reshard", choices=["auto", "true", "false"], default="auto",
        help="the baseline's reshard_after_forward; auto tries both in the first round and keeps the faster",
    )
    args = parser.parse_args(argv)
    spec = run_spec_from_args(args)

    ours_runs, theirs_runs = [], []
    reshard = None if args.baseline_reshard == "auto" else args.baseline_reshard == "true"
    for _ in range(args.rounds):
        ours_runs.append(run_hp(spec))
        if reshard is None:  # the baseline's best setting, from the first round
            tried = [run_baseline(spec, reshard_after_forward=value) for value in (True, False)]
            best = min(tried, key=lambda report: report["step_time_median_s"])
            reshard = best["reshard_after_forward"]
            theirs_runs.append(best)
        else:
            theirs_runs.append(run_baseline(spec, reshard_after_forward=reshard))
    # Each system's fastest round: the one the machine's noise hit least.
    ours = min(ours_runs, key=lambda report: report["step_time_median_s"])
    theirs = min(theirs_runs, key=lambda report: report["step_time_median_s"])
    for report in (ours, theirs):
        print(json.dumps(report), flush=True)
    _plot(args.plot, ours, theirs)
    print(json.dumps({
        "config": ours["config"],
        "throughput_ratio_hp_over_torch": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "peak_rss_ratio_hp_over_torch": ours["peak_rss_bytes_sum"] / theirs["peak_rss_bytes_sum"],
        "max_abs_loss_diff": max_abs_diff(ours["losses"], theirs["losses"]),
        "same_initial_weights": ours["weights_fingerprint"] == theirs["weights_fingerprint"],
        "baseline_reshard_after_forward": reshard,
        "plot": str(args.plot),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
