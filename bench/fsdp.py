"""hp.fully_shard vs torch's FSDP2 (Gloo), AdamW, side by side in one invocation.

    python bench/fsdp.py                         # qwen3-moe-small, 2 ranks, 8 steps, 2 rounds
    python bench/fsdp.py --config qwen3-moe-bench --steps 6

Both systems train the same seeded model on the same token stream with the same AdamW
(lr 2e-3, betas 0.9/0.95, wd 0.1), stock HF modules, every decoder layer and the root sharded,
one thread per rank. Runs alternate (hp, torch, hp, torch, ...) so the machine's noise hits both.
Per system: the median step time after the first 3 steps over all rounds; peak memory summed
over ranks, both as the OS's peak RSS (VmHWM, which counts a shared page once per rank that
maps it) and as peak PSS (each shared page split between the ranks that map it: the memory the
node really uses; sampled after every forward and backward); and the time each rank's main
thread waits on communication (hp: unshard waits and reduction waits; FSDP2: its all-gather
and reduce-scatter calls, which Gloo runs synchronously on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _spec import SKIP_STEPS, SyntheticTokens, add_run_args, build_model, run_spec_from_args
from _timing import StepTimer, peak_rss_bytes
from baseline_torch import _time_fsdp_collectives
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from transformers.utils import logging as hf_logging

import hyperparallel as hp
from hyperparallel.launch import run


def pss_bytes() -> int:
    """This process's proportional set size now (shared pages split among their mappers)."""
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(system: str, spec, reshard_after_forward) -> dict:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    if system == "hp":
        hp.comm.init()
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model(spec.config_path, spec.seed)
    timer = StepTimer()
    shard = hp.fully_shard if system == "hp" else torch_fully_shard
    for layer in model.model.layers:
        shard(layer, reshard_after_forward=reshard_after_forward)
    shard(model, reshard_after_forward=reshard_after_forward)
    if system == "torch":
        _time_fsdp_collectives(model, timer)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = SyntheticTokens(model.config.vocab_size, spec.seq_len, spec.seed)
    steps, peak_pss = [], pss_bytes()
    for step in range(spec.steps):
        batch = tokens.batch(step, spec, rank)
        dist.barrier()
        timer.begin_step()
        hp.fsdp.comm_wait_seconds(reset=True)
        start = time.perf_counter()
        with timer.phase("forward"):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        peak_pss = max(peak_pss, pss_bytes())
        with timer.phase("backward"):
            loss.backward()
        peak_pss = max(peak_pss, pss_bytes())
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        wall = time.perf_counter() - start
        record = timer.end_step(loss.item())
        comm = hp.fsdp.comm_wait_seconds() if system == "hp" else record.phases["comm_wait"]
        steps.append(
            {
                "wall": wall,
                "loss": record.loss,
                "comm_wait": comm,
                "forward": record.phases["forward"],
                "backward": record.phases["backward"],
                "optimizer": record.phases["optimizer"],
            }
        )
    return {"steps": steps, "peak_rss": peak_rss_bytes(), "peak_pss": peak_pss}


def _summary(system: str, runs: list[dict[int, dict]], spec) -> dict:
    """Medians over steps after warm-up, of each step's slowest rank, over all rounds."""
    walls, waits, losses = [], [], None
    phases = {"forward": [], "backward": [], "optimizer": []}
    for ranks in runs:
        for step in range(SKIP_STEPS, spec.steps):
            walls.append(max(r["steps"][step]["wall"] for r in ranks.values()))
            waits.append(max(r["steps"][step]["comm_wait"] for r in ranks.values()))
            for phase, values in phases.items():
                values.append(max(r["steps"][step][phase] for r in ranks.values()))
        losses = [ranks[0]["steps"][s]["loss"] for s in range(spec.steps)]
    step_time = statistics.median(walls)
    return {
        "system": system,
        "step_time_s": step_time,
        "tokens_per_s": spec.tokens_per_step / step_time,
        "comm_wait_s": statistics.median(waits),
        "comm_wait_share": statistics.median(waits) / step_time,
        "time_split_s": {phase: statistics.median(values) for phase, values in phases.items()},
        "peak_rss_bytes_sum": max(sum(r["peak_rss"] for r in ranks.values()) for ranks in runs),
        "peak_pss_bytes_sum": max(sum(r["peak_pss"] for r in ranks.values()) for ranks in runs),
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_args(parser)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of hp and torch")
    parser.add_argument(
        "--torch-reshard",
        choices=["true", "false"],
        default="false",
        help="FSDP2's reshard_after_forward (false measured faster on CPU)",
    )
    parser.set_defaults(steps=8)
    args = parser.parse_args()
    spec = run_spec_from_args(args)
    runs: dict[str, list] = {"hp": [], "torch": []}
    for _ in range(args.rounds):
        runs["hp"].append(run(_rank, nproc=spec.nproc, args=("hp", spec, None)))
        runs["torch"].append(run(_rank, nproc=spec.nproc, args=("torch", spec, args.torch_reshard == "true")))
    ours, theirs = _summary("hp", runs["hp"], spec), _summary("torch-fsdp2", runs["torch"], spec)
    for summary in (ours, theirs):
        print(json.dumps(summary))
    print(
        json.dumps(
            {
                "config": spec.config_path.name,
                "step_time_ratio_torch_over_hp": theirs["step_time_s"] / ours["step_time_s"],
                "peak_rss_ratio_hp_over_torch": ours["peak_rss_bytes_sum"] / theirs["peak_rss_bytes_sum"],
                "peak_pss_ratio_hp_over_torch": ours["peak_pss_bytes_sum"] / theirs["peak_pss_bytes_sum"],
                "hp_comm_wait_share": ours["comm_wait_share"],
                "torch_comm_wait_share": theirs["comm_wait_share"],
                "max_abs_loss_diff": max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])),
            }
        )
    )


if __name__ == "__main__":
    main()
