"""``hyperparallel train CONFIG.yaml [--nproc N] [key=value ...]``: check, prepare, launch."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

from hyperparallel import _log
from hyperparallel.trainer.config import (
    Config,
    ConfigError,
    check_files,
    check_vocab,
    check_world,
    load_config,
    resolve_device,
)

# oneDNN (bf16 GEMMs on the CPU) keeps a compiled primitive per GEMM shape in two caches.
# MoE experts see a new row count almost every call, so with the caches on a bf16 run's
# memory grows by tens of MiB per step (1.3 GiB per rank after 20 steps of the tiny
# default) for no speed: measured equal step times without them. Set before torch
# initialises oneDNN, in the launcher (ranks inherit it) and in each torchrun rank.
ONEDNN_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "1"}


def set_onednn_env() -> None:
    """Turn oneDNN's per-shape primitive caches off unless the user set them."""
    for key, value in ONEDNN_ENV.items():
        os.environ.setdefault(key, value)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperparallel train",
        description="Train a HF causal LM on a token file with hp.fully_shard, hp.nn and Muon (docs/train.md).",
        epilog="example: hyperparallel train examples/default.yaml --nproc 2 train.steps=50",
    )
    parser.add_argument("config", help="YAML config (docs/train.md lists every key)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. optim.lr=1e-3")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks on this machine (default: one per GPU on CUDA, else 1; under torchrun its "
                             "--nproc-per-node)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and the memory estimate per rank, train nothing")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in output.dir, deleting what a previous run left there")
    return parser


def _default_nproc(device: str) -> int:
    """One rank per GPU on CUDA; one rank on the CPU (each rank uses every core it is given)."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return 1


# What a run writes into output.dir: all that --overwrite deletes, and all that makes a
# directory "hold a run". Anything else there (the config, notes, the token file) is the user's.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "loss.png", "summary.json")


def _run_outputs(out: Path) -> list[Path]:
    return [out / name for name in RUN_OUTPUTS if os.path.lexists(out / name)]


def check_output(cfg: Config, overwrite: bool) -> str:
    """What to do with ``output.dir``: "fresh" or "resume"; raises ConfigError if it holds a run.

    Nothing is deleted here; :func:`clear_output` does that for ``--overwrite``.
    """
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file; set output.dir to a directory")
    outputs = _run_outputs(out)
    if overwrite or not outputs:
        return "fresh"
    from hyperparallel.trainer.state import latest_checkpoint

    if cfg.checkpoint.resume and latest_checkpoint(out / "checkpoints"):
        return "resume"
    why = "nothing to resume from" if cfg.checkpoint.resume else "checkpoint.resume is false"
    raise ConfigError(
        f"output.dir: {out} already holds a run ({', '.join(p.name for p in outputs)}) and {why}; "
        "pass --overwrite to replace it, or set output.dir to a new directory"
    )


def clear_output(cfg: Config) -> None:
    """Delete a previous run's outputs from ``output.dir`` (``--overwrite``), and nothing else."""
    for path in _run_outputs(Path(cfg.output.dir)):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def ensure_tokens(cfg: Config) -> None:
    """Make ``data.tokens`` from ``data.prepare`` if it does not exist (one process per node)."""
    if Path(cfg.data.tokens).is_file():
        return
    p = cfg.data.prepare
    print(f"hyperparallel train: {cfg.data.tokens} is missing; tokenizing {', '.join(p.text)} "
          f"({'training a BPE of ' + str(p.vocab_size) if p.tokenizer == 'bpe' else p.tokenizer})", flush=True)
    from hyperparallel.trainer.tokenize import prepare

    try:
        meta = prepare(p.text, cfg.data.tokens, tokenizer=p.tokenizer, vocab_size=p.vocab_size,
                       eos_token=p.eos_token)
    except (ValueError, OSError) as error:
        raise ConfigError(f"data.prepare: making {cfg.data.tokens} failed: {error}") from None
    print(f"hyperparallel train: wrote {cfg.data.tokens}: {meta['num_tokens']:,} tokens", flush=True)


def main(argv: list[str]) -> int:
    """The ``train`` subcommand; returns the exit status."""
    set_onednn_env()
    args = _parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.nproc is not None and args.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
        nproc = args.nproc or _default_nproc(resolve_device(cfg))
        world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else nproc
        check_world(cfg, world)
        if args.dry_run:
            check_files(cfg)
            from hyperparallel.trainer.estimate import dry_run

            plan = dry_run(cfg, world)
            if Path(cfg.data.tokens).is_file():  # else the run will make it
                from hyperparallel.trainer.model import hf_config

                check_vocab(cfg, hf_config(cfg).vocab_size)
            print(plan)
            return 0
        check_files(cfg)
        mode = check_output(cfg, args.overwrite)
    except ConfigError as error:
        print(f"hyperparallel train: {error}", file=sys.stderr)
        return 2
    if _under_torchrun():
        return _as_torchrun_rank(cfg, args.overwrite, mode)
    try:
        ensure_tokens(cfg)
        from hyperparallel.trainer.model import hf_config

        check_vocab(cfg, hf_config(cfg).vocab_size)
    except ConfigError as error:
        print(f"hyperparallel train: {error}", file=sys.stderr)
        return 2
    if mode == "fresh" and args.overwrite:  # every check passed: nothing is lost to a refused run
        clear_output(cfg)
    # On a GPU the estimate traces the model on CUDA fake tensors, which makes a CUDA context:
    # rank 0 makes it there, not this launcher, whose context would hold GPU 0's memory all run.
    estimate = None
    if resolve_device(cfg) != "cuda":
        from hyperparallel.trainer.estimate import allocated_or_none

        estimate = allocated_or_none(cfg, world)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hyperparallel.launch import run
    from hyperparallel.trainer.loop import rank_main

    try:
        with _quiet_launcher():
            run(rank_main, nproc=nproc, args=(cfg.to_dict(), estimate))
    except ChildFailedError as error:
        rank, first = error.get_first_failure()
        print(_failure_text(rank, first), file=sys.stderr)
        return 1
    except SignalException as error:  # the launcher was told to stop: torch elastic stopped the ranks with it
        from hyperparallel.trainer.state import latest_checkpoint

        latest = latest_checkpoint(Path(cfg.output.dir) / "checkpoints")
        print(f"hyperparallel train: stopped by {error.sigval.name}, and the ranks with it; "
              + (f"the latest complete checkpoint is {latest}: run the same command to resume from it"
                 if latest else "no checkpoint was complete"), file=sys.stderr)
        return 128 + error.sigval.value
    return 0


@contextlib.contextmanager
def _quiet_launcher():
    """torch elastic logs a failing rank's traceback with its prefix on every line, and its
    own shutdown as warnings; the failure is reported once by _failure_text instead (HP_LOG=debug
    lets them through)."""
    if _log.level() <= logging.DEBUG:
        yield
        return
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


# What usually helps, for failures whose message cannot say it.
_OUT_OF_MEMORY = ("lower train.micro_batch or turn on model.activation_checkpointing "
                  "(`hyperparallel train --dry-run` estimates the memory per rank)")
_FIXES = {"OutOfMemoryError": _OUT_OF_MEMORY, "MemoryError": _OUT_OF_MEMORY}


def failure_text(rank: int, kind: str, message: str, trace: str | None) -> str:
    """A rank's failure as one paragraph: rank, exception type, message, the fix where one is
    known; the traceback follows only with ``HP_LOG=debug``."""
    text = f"hyperparallel train: rank {rank} failed: {kind}: {message.strip()}"
    if kind in _FIXES:
        text += f"\n  fix: {_FIXES[kind]}"
    if trace and _log.level() <= logging.DEBUG:
        text += "\n" + trace.rstrip()
    elif trace:
        text += "\n  (HP_LOG=debug shows where it was raised)"
    return text


def _failure_text(rank: int, failure) -> str:
    """failure_text for a rank torch elastic reports as failed (a ProcessFailure)."""
    recorded = (failure.error_file_data or {}).get("message")
    if isinstance(recorded, dict):  # what @record wrote: "Type: message" and the traceback
        kind, _, message = str(recorded.get("message", "")).partition(": ")
        return failure_text(rank, kind, message, recorded.get("extraInfo", {}).get("py_callstack"))
    if failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        return (f"hyperparallel train: rank {rank} was killed by {name} and left no error"
                + (f"; the kernel's out-of-memory killer is the usual cause (see dmesg): {_OUT_OF_MEMORY}"
                   if name == "SIGKILL" else ""))
    return f"hyperparallel train: rank {rank} exited with code {failure.exitcode} and left no error"


def _as_torchrun_rank(cfg: Config, overwrite: bool, mode: str) -> int:
    """Every rank of a torchrun job runs the CLI: local rank 0 prepares, global rank 0 clears."""
    import torch.distributed as dist

    import hyperparallel as hp
    from hyperparallel.trainer.loop import rank_main

    hp.comm.init()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        ensure_tokens(cfg)
    dist.barrier()
    if dist.get_rank() == 0 and mode == "fresh" and overwrite:
        clear_output(cfg)
    dist.barrier()
    try:
        rank_main(cfg.to_dict(), None)
    except Exception as error:  # noqa: BLE001 -- reported as one paragraph; torchrun reports the exit code
        print(failure_text(dist.get_rank(), type(error).__name__, str(error), traceback.format_exc()),
              file=sys.stderr, flush=True)
        return 1
    return 0
