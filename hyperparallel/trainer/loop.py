"""The training loop one rank runs (started by ``hyperparallel train`` or by torchrun).

:class:`Trainer` reads in the order it runs: ``__init__`` sets up (model, optimizers,
data, resume), :meth:`Trainer.train_step` is one optimizer step, :meth:`Trainer.train`
loops over steps, checkpoints, and hands rank 0 the summary.

Example (every rank of a torch.distributed job)::

    summary = Trainer(load_config("examples/default.yaml").to_dict()).train()
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hyperparallel as hp
from hyperparallel._memory import rss_bytes
from hyperparallel.trainer import estimate as estimate_lib
from hyperparallel.trainer import model as model_lib
from hyperparallel.trainer import optim as optim_lib
from hyperparallel.trainer import report
from hyperparallel.trainer import state as state_lib
from hyperparallel.trainer.config import Config, check_vocab, check_world, from_dict, resolve_device
from hyperparallel.trainer.data import TokenLoader


class Trainer:
    """One rank's part of the run ``cfg_dict`` describes (collective over the torch.distributed job).

    Rank 0 writes ``metrics.jsonl``, the plot and ``summary.json``, and prints the summary.
    ``estimate_bytes``: the dry-run's memory estimate per rank (:attr:`Estimate.allocated`),
    shown beside the measured peak; on a GPU, None makes rank 0 compute it.
    """

    def __init__(self, cfg_dict: dict[str, Any], estimate_bytes: int | None = None) -> None:
        self.cfg_dict, self.estimate_bytes = cfg_dict, estimate_bytes
        self.cfg = cfg = from_dict(cfg_dict)
        torch.set_num_threads(_threads(cfg))
        hp.comm.init()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        check_world(cfg, self.world)
        self.accumulation = cfg.accumulation(self.world)
        self.out = Path(cfg.output.dir)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        self.t_start = time.perf_counter()

        self.device = model_lib.rank_device(resolve_device(cfg))
        if self.device.type == "cuda" and self.estimate_bytes is None and self.rank == 0:
            # The launcher leaves the GPU estimate to this rank, which has a CUDA context (the
            # trace makes one).
            self.estimate_bytes = estimate_lib.allocated_or_none(cfg, self.world)
        mesh = model_lib.build_mesh(self.device.type)
        self.model = model_lib.build_sharded(cfg, mesh, self.device)
        # Every rank's generators start the run alike, from the seed, whatever the estimate drew
        # (the build draws from its own, given back after).
        torch.manual_seed(cfg.model.seed)
        self.params = model_lib.count_params(self.model)
        self.optimizers = optim_lib.build(self.model, cfg)
        self.loader = TokenLoader(
            cfg.data.tokens, seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch,
            micro_batch=cfg.train.micro_batch, dp_rank=self.rank, dp_size=self.world, seed=cfg.data.seed,
        )
        check_vocab(cfg, self.model.config.vocab_size)
        hf = self.model.config
        self.aux_coef = getattr(hf, "router_aux_loss_coef", 0.0) if getattr(hf, "output_router_logits", False) else 0.0

        self.manager = state_lib.manager(self.out / "checkpoints", cfg.checkpoint.keep_last)
        self.step = self._resume()
        self.stop = cfg.train.stop_at or cfg.train.steps
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.phases = report.Phases(self.device)
        self.peak_device_bytes, self.device_steps = 0, 0

    def _resume(self) -> int:
        """The step to start from: the latest checkpoint's, loaded into model, optimizers and loader; else 0."""
        if not self.cfg.checkpoint.resume or self.manager.latest() is None:
            return 0
        trainer = state_lib.trainer_state(0, self.loader, self.cfg_dict, self.device)
        loaded = state_lib.full_state(self.model, self.optimizers, trainer)
        try:
            found = self.manager.load_latest(loaded)
        except hp.checkpoint.CheckpointMismatchError as error:
            raise hp.checkpoint.CheckpointError(
                f"{self.manager.latest()} holds another model or optimizer than this config's ({error}); to start "
                "afresh pass --overwrite, or set output.dir to a new directory"
            ) from None
        if found is None:
            raise RuntimeError(f"{self.manager.root}: the latest checkpoint vanished while loading")
        step = state_lib.apply_state(self.model, self.optimizers, loaded, self.loader, self.device)
        if self.rank == 0:
            print(f"hyperparallel train: resumed from {self.manager.latest()} at step {step}", flush=True)
        return step

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``accumulation`` micro-batches; its metrics record (same on every rank)."""
        t0 = time.perf_counter()
        self.phases.reset()
        lr = optim_lib.lr_at(self.cfg, self.step)
        optim_lib.set_lr(self.optimizers, lr)
        losses = torch.zeros(2, dtype=torch.float64, device=self.device)  # lm loss, aux loss; summed over micro-batches
        for micro in range(self.accumulation):
            self.model.set_requires_gradient_sync(micro == self.accumulation - 1)
            ids = self.phases.run("data", self._micro_batch, micro)
            output = self.phases.run("forward", self._forward, ids)
            aux = (output.aux_loss.detach() if self.aux_coef and output.aux_loss is not None
                   else torch.zeros((), device=self.device))
            losses += torch.stack([output.loss.detach() - self.aux_coef * aux, aux]).double()
            self.phases.run("backward", self._backward, output.loss)
        grad_norm = self.phases.run("optimizer", self._optimizer_step)
        self.loader.advance()
        self.step += 1
        losses = (losses / self.accumulation).float()
        hp.comm.all_reduce(losses, "avg")
        loss, aux_loss = losses.tolist()
        wall = time.perf_counter() - t0
        if self.device.type == "cuda":
            # This rank's own device memory but for the CUDA context: torch's allocator at this
            # step's peak (what it reserved) and hp's peer-mapped buffers beside it. Not the
            # device's count, which holds every process on the GPU (ranks sharing it, other
            # jobs). The first step's figure stands only alone: Muon makes its plan's buffer
            # after that step's peak, in cache memory it empties for it, and the sum would count
            # that memory twice; from the second step on the buffers live through the step.
            now = torch.cuda.max_memory_reserved(self.device) + hp.comm.device_bytes()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.device_steps += 1
            self.peak_device_bytes = now if self.device_steps <= 2 else max(self.peak_device_bytes, now)
        return {
            "step": self.step, "loss": loss, "aux_loss": aux_loss, "lr": lr, "grad_norm": grad_norm,
            "tokens": self.step * self.tokens_per_step, "tokens_per_s": self.tokens_per_step / wall, "step_s": wall,
            **{f"{k}_s": v for k, v in self.phases.times.items()}, "epoch": self.loader.epoch,
        }

    def _micro_batch(self, micro: int) -> torch.Tensor:
        return self.loader.micro_batch(micro).to(self.device)

    def _forward(self, ids: torch.Tensor):
        return self.model(input_ids=ids, labels=ids)

    def _backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()

    def _optimizer_step(self) -> float:
        norm = optim_lib.clip_grad_norm(self.model, self.cfg.train.max_grad_norm)
        for opt in self.optimizers.values():
            opt.step()
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        return norm

    def train(self) -> dict[str, Any]:
        """Steps until ``train.stop_at`` (or ``train.steps``), checkpointing as configured; this rank's
        summary (rank 0's holds the whole run's, also in ``summary.json``)."""
        cfg, first_step = self.cfg, self.step + 1
        if self.step >= self.stop and self.rank == 0:
            print(f"hyperparallel train: nothing to do: the checkpoint is at step {self.step} and the run stops at "
                  f"{self.stop}; raise train.steps (or train.stop_at) to continue, or pass --overwrite to start "
                  "afresh", flush=True)
        metrics = report.Metrics(self.out / "metrics.jsonl", keep_until=self.step) if self.rank == 0 else None
        progress = report.Progress(cfg.train.steps, self.step, self.stop, cfg.output.log_every,
                                   cfg.output.progress and self.rank == 0)
        records: list[dict[str, Any]] = []
        saved: Path | None = None
        t_loop = time.perf_counter()
        if self.device.type == "cuda":  # the steps' peaks, not the set-up's (a group's full size while sharding it)
            torch.cuda.reset_peak_memory_stats(self.device)
        while self.step < self.stop:
            record = self.train_step()
            records.append(record)
            if metrics is not None:
                metrics.write(record)
            progress.update(self.step, record["loss"], record["lr"], record["tokens_per_s"])
            saved = self._checkpoint() or saved
        self.manager.wait()
        progress.close()
        loop_s = time.perf_counter() - t_loop

        # Every rank's measurements, for rank 0's summary.
        mine = {"peak_rss_bytes": rss_bytes(peak=True), "peak_device_bytes": self.peak_device_bytes,
                "per_step": [{"step_s": r["step_s"], **{p: r[f"{p}_s"] for p in report.PHASES}} for r in records]}
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        summary: dict[str, Any] = {"rank": self.rank, "peak_rss_bytes": mine["peak_rss_bytes"],
                                   "steps_run": len(records)}
        if self.rank == 0:
            summary = report.summarize({
                **summary, "model": type(self.model).__name__.removeprefix("HP"), "params": self.params,
                "world_size": self.world, "device": self.device.type, "optimizer": "+".join(self.optimizers),
                "precision": cfg.model.mixed_precision, "patch": cfg.model.patch,
                "activation_checkpointing": cfg.model.activation_checkpointing,
                "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
                "accumulation": self.accumulation, "seq_len": cfg.data.seq_len,
                "first_step": first_step, "last_step": self.step,
                "first_loss": records[0]["loss"] if records else None,
                "last_loss": records[-1]["loss"] if records else None,
                "tokens": len(records) * self.tokens_per_step, "wall_s": time.perf_counter() - self.t_start,
                "loop_s": loop_s, "estimate_bytes_per_rank": self.estimate_bytes, "output_dir": str(self.out),
                "checkpoint": str(saved) if saved else None, "plot": cfg.output.plot and bool(records),
            }, gathered)
            metrics.close()
            if records:
                if cfg.output.plot:
                    report.plot(self.out / "metrics.jsonl", self.out / "loss.png")
                (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
                print(report.summary_text(summary), flush=True)
        dist.barrier()
        return summary

    def _checkpoint(self) -> Path | None:
        """Save if this step is due (every ``checkpoint.every`` steps, and the last); where, or None."""
        ckpt, step = self.cfg.checkpoint, self.step
        last = step == self.stop and (ckpt.final or self.stop < self.cfg.train.steps)
        if not ((ckpt.every and step % ckpt.every == 0) or last):
            return None
        snapshot = state_lib.full_state(self.model, self.optimizers,
                                        state_lib.trainer_state(step, self.loader, self.cfg_dict, self.device))
        return self.manager.save(step, snapshot, async_=ckpt.async_save)


def _threads(cfg: Config) -> int:
    if cfg.train.threads_per_rank:
        return cfg.train.threads_per_rank
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local)


def rank_main(cfg_dict: dict[str, Any], estimate_bytes: int | None = None) -> dict[str, Any]:
    """Train one rank of the job ``cfg_dict`` describes; this rank's summary (the launchers' entry point)."""
    return Trainer(cfg_dict, estimate_bytes).train()
