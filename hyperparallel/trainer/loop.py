"""The training loop one rank runs (started by ``hyperparallel train`` or by torchrun)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hyperparallel.trainer import data as data_lib
from hyperparallel.trainer import model as model_lib
from hyperparallel.trainer import optim as optim_lib
from hyperparallel.trainer import report
from hyperparallel.trainer import state as state_lib
from hyperparallel.trainer.config import Config, check_vocab, check_world, from_dict

PHASES = ("data", "forward", "backward", "optimizer", "comm_wait")


class _Phases:
    """Wall time per phase of a step; waits on other ranks (hp.fsdp.comm_wait_seconds) are
    taken out of the phase they happened in and counted as ``comm_wait``."""

    def __init__(self) -> None:
        from hyperparallel.fsdp import comm_wait_seconds

        self._waits = comm_wait_seconds
        self.times = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        self.times = dict.fromkeys(PHASES, 0.0)

    def run(self, name: str, fn, *args):
        start, waited = time.perf_counter(), self._waits()
        result = fn(*args)
        wait = self._waits() - waited
        self.times[name] += time.perf_counter() - start - wait
        self.times["comm_wait"] += wait
        return result


def _threads(cfg: Config) -> int:
    if cfg.train.threads_per_rank:
        return cfg.train.threads_per_rank
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local)


def rank_main(cfg_dict: dict[str, Any], estimate_bytes: int | None = None) -> dict[str, Any]:
    """Train one rank of the job ``cfg_dict`` describes; return this rank's summary.

    Collective over every rank of the torch.distributed job (environment from torchrun
    or ``hyperparallel train``). Rank 0 writes metrics.jsonl, the plot and summary.json.
    """
    import hyperparallel as hp

    cfg = from_dict(cfg_dict)
    torch.set_num_threads(_threads(cfg))
    hp.comm.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_world(cfg, world)
    accumulation = cfg.accumulation(world)
    out = Path(cfg.output.dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    mesh = model_lib.build_mesh()
    model = model_lib.build(cfg)
    params = model_lib.count_params(model)
    vocab = model.config.vocab_size
    if cfg.model.activation_checkpointing:
        model_lib.checkpoint_layers(model)
    model_lib.shard(model, cfg, mesh)
    optimizers = optim_lib.build(model, cfg)
    loader = data_lib.TokenLoader(
        cfg.data.tokens, seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch,
        micro_batch=cfg.train.micro_batch, dp_rank=rank, dp_size=world, seed=cfg.data.seed,
    )
    check_vocab(cfg, vocab)
    coef = getattr(model.config, "router_aux_loss_coef", 0.0) if getattr(
        model.config, "output_router_logits", False) else 0.0

    manager = state_lib.manager(out / "checkpoints", cfg.checkpoint.keep_last)
    step = 0
    if cfg.checkpoint.resume and manager.latest() is not None:
        loaded = state_lib.full_state(model, optimizers, state_lib.trainer_state(0, loader, cfg_dict))
        if manager.load_latest(loaded) is None:
            raise RuntimeError(f"{out / 'checkpoints'}: the latest checkpoint vanished while loading")
        step = state_lib.apply_state(model, optimizers, loaded, loader)
        del loaded
        if rank == 0:
            print(f"hyperparallel train: resumed from {manager.latest()} at step {step}", flush=True)
    stop = cfg.train.stop_at or cfg.train.steps
    if step >= stop and rank == 0:
        print(f"hyperparallel train: nothing to do: the checkpoint is at step {step} and the run stops at {stop}; "
              "raise train.steps (or train.stop_at) to continue, or pass --overwrite to start afresh", flush=True)
    metrics = report.Metrics(out / "metrics.jsonl", keep_until=step) if rank == 0 else None
    progress = report.Progress(cfg.train.steps, step, cfg.output.log_every, cfg.output.progress and rank == 0)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    phases = _Phases()
    per_step: list[dict[str, float]] = []
    first_loss = last_loss = None
    first_step = step + 1
    saved: Path | None = None
    t_loop = time.perf_counter()

    def forward(ids):
        return model(input_ids=ids, labels=ids)

    def backward(loss):
        (loss / accumulation).backward()

    def optimizer_step():
        norm = optim_lib.clip_grad_norm(model, cfg.train.max_grad_norm)
        for opt in optimizers.values():
            opt.step()
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=True)
        return norm

    while step < stop:
        t0 = time.perf_counter()
        phases.reset()
        lr = optim_lib.lr_at(cfg, step)
        optim_lib.set_lr(optimizers, lr)
        losses = torch.zeros(2, dtype=torch.float64)  # lm loss, aux loss; summed over micro-batches
        for micro in range(accumulation):
            model.set_requires_gradient_sync(micro == accumulation - 1)
            ids = phases.run("data", loader.micro_batch, micro)
            output = phases.run("forward", forward, ids)
            aux = output.aux_loss.detach() if coef and output.aux_loss is not None else torch.zeros(())
            losses += torch.stack([output.loss.detach() - coef * aux, aux]).double()
            phases.run("backward", backward, output.loss)
        grad_norm = phases.run("optimizer", optimizer_step)
        loader.advance()
        step += 1
        losses = (losses / accumulation).float()
        hp.comm.all_reduce(losses, "avg")
        loss, aux_loss = losses.tolist()
        wall = time.perf_counter() - t0
        per_step.append({"step_s": wall, **phases.times})
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        if metrics is not None:
            metrics.write({
                "step": step, "loss": loss, "aux_loss": aux_loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": step * tokens_per_step, "tokens_per_s": tokens_per_step / wall, "step_s": wall,
                **{f"{k}_s": v for k, v in phases.times.items()}, "epoch": loader.epoch,
            })
        progress.update(step, loss, lr, tokens_per_step / wall)
        every = cfg.checkpoint.every
        if (every and step % every == 0) or (step == stop and (cfg.checkpoint.final or stop < cfg.train.steps)):
            snapshot = state_lib.full_state(model, optimizers, state_lib.trainer_state(step, loader, cfg_dict))
            saved = manager.save(step, snapshot, async_=cfg.checkpoint.async_save)
    manager.wait()
    progress.close()
    loop_s = time.perf_counter() - t_loop

    # Every rank's measurements, for rank 0's summary.
    mine = {"peak_rss_bytes": report.peak_rss_bytes(), "per_step": per_step}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    steps_run = len(per_step)
    summary: dict[str, Any] = {"rank": rank, "peak_rss_bytes": mine["peak_rss_bytes"], "steps_run": steps_run}
    if rank == 0:
        skip = 1 if steps_run > 3 else 0  # the first step builds plans and touches memory
        split = {
            name: statistics.fmean(statistics.fmean(r["per_step"][i][name] for r in gathered)
                                   for i in range(skip, steps_run)) if steps_run else 0.0
            for name in PHASES
        }
        walls = [max(r["per_step"][i]["step_s"] for r in gathered) for i in range(skip, steps_run)]
        step_median = statistics.median(walls) if walls else 0.0
        split["other"] = max(0.0, (statistics.fmean(walls) if walls else 0.0) - sum(split.values()))
        names = list(optimizers)
        summary.update({
            "model": type(model).__name__.removeprefix("HP"), "params": params, "world_size": world,
            "optimizer": "+".join(names), "precision": cfg.model.mixed_precision, "patch": cfg.model.patch,
            "activation_checkpointing": cfg.model.activation_checkpointing,
            "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
            "accumulation": accumulation, "seq_len": cfg.data.seq_len,
            "first_step": first_step, "last_step": step, "first_loss": first_loss, "last_loss": last_loss,
            "tokens": steps_run * tokens_per_step, "wall_s": time.perf_counter() - t_start, "loop_s": loop_s,
            "tokens_per_s": tokens_per_step / step_median if step_median else 0.0, "step_s_median": step_median,
            "time_split_s": split,
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in gathered],
            "estimate_bytes_per_rank": estimate_bytes,
            "output_dir": str(out), "checkpoint": str(saved) if saved else None,
            "plot": cfg.output.plot and steps_run > 0,
        })
        metrics.close()
        if steps_run:
            if cfg.output.plot:
                report.plot(out / "metrics.jsonl", out / "loss.png")
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            print(report.summary_text(summary), flush=True)
    dist.barrier()
    return summary
