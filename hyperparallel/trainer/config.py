"""The trainer's configuration: plain data in YAML, checked before anything runs.

A config file has six sections (``model``, ``data``, ``train``, ``optim``,
``checkpoint``, ``output``); every key has a default (docs/train.md lists them)
and ``key=value`` overrides on the command line use dotted names::

    hyperparallel train examples/default.yaml train.steps=50 optim.lr=1e-3

Mistakes are reported as :class:`ConfigError` naming the key and the fix: an
unknown key gets the nearest known one (difflib), a value of the wrong type
shows the expected type and an example. Relative paths are relative to the
working directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hyperparallel.trainer.data import TokenFileError, read_meta


class ConfigError(ValueError):
    """A configuration mistake; the message names the key and how to fix it."""


@dataclass
class ModelConfig:
    """What to train."""

    config: str | None = None  # a HF config.json: a model with fresh weights
    pretrained: str | None = None  # a HF model directory (config.json + safetensors): start from its weights
    patch: bool = True  # hp.nn.patch: fused RMSNorm / attention / MoE modules
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    mixed_precision: str = "float32"  # "bfloat16": bf16 forward/backward, fp32 weights, grads and optimizer
    seed: int = 0  # initial weights (a fresh model)


@dataclass
class PrepareConfig:
    """How ``data.tokens`` is made when it does not exist (``hyperparallel data prepare``)."""

    text: list[str] = field(default_factory=list)  # text files; documents are separated by blank lines
    tokenizer: str = "bpe"  # "bpe": train a byte-level BPE on the text; or a directory / tokenizer.json
    vocab_size: int = 2048  # for "bpe"
    eos_token: str | None = None  # appended after each document; None: the tokenizer's own


@dataclass
class DataConfig:
    """The memory-mapped token file and how it is cut into samples."""

    tokens: str = "runs/data/tokens.bin"
    seq_len: int = 256
    seed: int = 0  # sample order (a fresh permutation per epoch)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)


@dataclass
class TrainConfig:
    """Batch, length and the loop."""

    steps: int = 100  # optimizer steps; the LR schedule spans them
    global_batch: int = 16  # sequences per optimizer step, over all ranks
    micro_batch: int = 4  # sequences per rank per forward; accumulation = global / (micro x ranks)
    max_grad_norm: float = 1.0  # clip the global gradient norm; 0 disables
    stop_at: int | None = None  # stop (with a checkpoint) after this step; the schedule still spans `steps`
    threads_per_rank: int = 0  # torch intra-op threads per rank; 0: cores / local ranks
    device: str = "auto"  # "cuda": GPUs (local rank i on GPU i modulo their count); "cpu"; "auto": CUDA if present


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "muon"  # "muon": Muon for hidden matrices + AdamW for the rest; "adamw": AdamW for all
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr x this at the last step
    warmup_steps: int = 10  # linear warm-up from lr / warmup_steps
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW
    eps: float = 1e-8  # AdamW
    momentum: float = 0.95  # Muon
    nesterov: bool = True  # Muon
    ns_steps: int = 5  # Muon's Newton-Schulz iterations


@dataclass
class CheckpointConfig:
    """Periodic and final checkpoints (hp.checkpoint, DCP format) under ``output.dir/checkpoints``."""

    every: int = 0  # save every this many steps; 0: only the final one
    keep_last: int = 3
    final: bool = True  # save after the last step
    resume: bool = True  # continue from the latest checkpoint in output.dir if there is one
    async_save: bool = False  # write in the background while training goes on


@dataclass
class OutputConfig:
    """Where results go, and what is reported."""

    dir: str = "runs/default"
    log_every: int = 10  # progress lines when stderr is not a terminal; metrics.jsonl gets every step
    plot: bool = True  # loss / throughput PNG at the end
    progress: bool = True  # progress bar on rank 0


@dataclass
class Config:
    """A whole training run (one YAML file)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain data (what YAML holds); :func:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per rank and step (checked by :func:`check_world`)."""
        return self.train.global_batch // (self.train.micro_batch * world_size)


CHOICES = {
    "train.device": ("auto", "cpu", "cuda"),
    "model.mixed_precision": ("float32", "bfloat16"),
    "optim.name": ("muon", "adamw"),
}


# ---------------------------------------------------------------------------------------------
# Reading and checking
# ---------------------------------------------------------------------------------------------


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            out += _keys(hint, name + ".")
        else:
            out.append(name)
    return out


ALL_KEYS = _keys(Config)


def _unknown(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # a misspelt last part: compare within the section
        section, _, leaf = key.rpartition(".")
        leaves = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section]
        close = [f"{section}.{m}" if section else m for m in difflib.get_close_matches(leaf, leaves, n=1)]
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
    return ConfigError(f"config key '{key}' is unknown{hint}")


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(hint, str(hint))


class _Loader(yaml.SafeLoader):
    """YAML as configs are written: only true/false are booleans and nothing is a date, so a
    string key takes `off`, `yes` or `2024-01-05` as written (a true/false key takes yes/no/on/off
    too, in _coerce)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _coerce(key: str, value: Any, hint: Any, default: Any) -> Any:
    """``value`` as ``hint``, or a ConfigError saying what was expected."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg, default)
            except ConfigError as error:
                errors.append(error)
        raise errors[0]
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and item is str:
            value = [value]  # a single file
        if not isinstance(value, list):
            raise _wrong(key, value, hint, default)
        return [_coerce(f"{key}[{i}]", v, item, None) for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("yes", "no", "on", "off"):
            return value.lower() in ("yes", "on")
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise _wrong(key, value, hint, default)


def _wrong(key: str, value: Any, hint: Any, default: Any) -> ConfigError:
    example = f" (the default is {json.dumps(default)})"
    if default is None or dataclasses.is_dataclass(default):
        example = ""
    return ConfigError(
        f"config key '{key}' must be {_type_name(hint)}, got {value!r} ({type(value).__name__}){example}"
    )


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config section '{prefix.rstrip('.') or '(top level)'}' must be a mapping of keys to values, "
            f"got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known = [k for k in ALL_KEYS if k.startswith(prefix)]
    kwargs = {}
    for name, value in data.items():
        key = prefix + str(name)
        if name not in fields:
            raise _unknown(key, known if prefix else ALL_KEYS + [f.name for f in dataclasses.fields(Config)])
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key + ".")
        else:
            f = fields[name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            kwargs[name] = _coerce(key, value, hint, default)
            choices = CHOICES.get(key)
            if choices and kwargs[name] not in choices:
                raise ConfigError(f"config key '{key}' must be one of {', '.join(choices)}; got {value!r}")
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> Config:
    """A Config from nested plain data (``Config.to_dict()``'s form), with the same checks as a file."""
    cfg = _build(Config, data, "")
    check_values(cfg)
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=1e-3"`` -> (["optim", "lr"], 0.001); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not key=value (example: train.steps=100)")
    parts = key.strip().split(".")
    try:
        return parts, _yaml(value) if value.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML ({getattr(error, 'problem', None) or error}); "
            f"quote it for a string: '{key.strip()}=\"...\"'"
        ) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply ``key=value`` overrides, check keys, types and values.

    Example::

        cfg = load_config("examples/default.yaml", ["train.steps=20"])
        cfg.train.steps   # 20
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = _yaml(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections (model:, data:, ...)")
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:  # absent, or a section whose keys are all commented out
                child = node[part] = {}
            elif not isinstance(child, dict):
                section = ".".join(parts[: i + 1])
                raise ConfigError(f"override {text!r}: '{section}' is not a section")
            node = child
        node[parts[-1]] = value
    cfg = _build(Config, data, "")
    check_values(cfg)
    return cfg


def check_values(cfg: Config) -> None:
    """Range checks that do not depend on the world size or the file system."""
    m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
    if (m.config is None) == (m.pretrained is None):
        raise ConfigError(
            "set exactly one of 'model.config' (a HF config.json: fresh weights) and "
            "'model.pretrained' (a HF model directory: its weights)"
        )
    positive = {
        "train.steps": t.steps, "train.global_batch": t.global_batch, "train.micro_batch": t.micro_batch,
        "data.seq_len": d.seq_len, "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "data.prepare.vocab_size": d.prepare.vocab_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}' must be at least 1, got {value}")
    non_negative = {
        "optim.lr": o.lr, "optim.warmup_steps": o.warmup_steps, "optim.weight_decay": o.weight_decay,
        "train.max_grad_norm": t.max_grad_norm, "checkpoint.every": cfg.checkpoint.every,
        "train.threads_per_rank": t.threads_per_rank, "optim.min_lr_ratio": o.min_lr_ratio,
        "optim.ns_steps": o.ns_steps, "optim.momentum": o.momentum,
    }
    for key, value in non_negative.items():
        if not value >= 0:  # NaN too
            raise ConfigError(f"config key '{key}' must be a number >= 0, got {value}")
    if not o.min_lr_ratio <= 1:
        raise ConfigError(f"config key 'optim.min_lr_ratio' is the final lr over the peak: at most 1, got {o.min_lr_ratio}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"config key 'optim.betas' must be two numbers in [0, 1) like [0.9, 0.95], got {o.betas}")
    if t.stop_at is not None and not 1 <= t.stop_at <= t.steps:
        raise ConfigError(f"config key 'train.stop_at' must be between 1 and train.steps={t.steps}, got {t.stop_at}")
    if cfg.output.log_every < 1:
        raise ConfigError(f"config key 'output.log_every' must be at least 1, got {cfg.output.log_every}")


def check_world(cfg: Config, world_size: int) -> None:
    """The batch must split evenly over ``world_size`` ranks and micro-batches."""
    t = cfg.train
    per_step = t.micro_batch * world_size
    if t.global_batch % per_step:
        lower = max(per_step, t.global_batch // per_step * per_step)
        ranks = [w for w in range(1, t.global_batch + 1) if t.global_batch % (w * t.micro_batch) == 0]
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch x world size = "
            f"{t.micro_batch} x {world_size} = {per_step}; set train.global_batch to a multiple of {per_step} "
            f"(e.g. {lower}), or run on {' / '.join(map(str, ranks)) or 'other'} ranks"
        )


def resolve_device(cfg: Config) -> str:
    """``train.device`` as the device type the ranks compute on, "cpu" or "cuda"; ConfigError if
    CUDA is asked for where torch or hyperparallel cannot use it."""
    import torch

    asked = cfg.train.device
    if asked == "cpu":
        return "cpu"
    from hyperparallel import _C

    usable = torch.cuda.is_available() and "cuda" in _C.device_backends()
    if asked == "auto":
        return "cuda" if usable else "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(
            f"train.device is cuda but torch {torch.__version__} sees no GPU (a CPU build of torch, or no driver); "
            "set train.device=cpu, or install a CUDA build of torch"
        )
    if not usable:
        raise ConfigError(
            "train.device is cuda but this build of hyperparallel has no CUDA backend; rebuild it against the "
            "installed CUDA torch with nvcc on PATH (bash scripts/setup.sh), or set train.device=cpu"
        )
    return "cuda"


def check_vocab(cfg: Config, model_vocab: int) -> None:
    """The token file's vocabulary must fit the model's embedding."""
    vocab = _token_meta(cfg)["vocab_size"]
    if vocab > model_vocab:
        raise ConfigError(
            f"data.tokens: {cfg.data.tokens} has a vocabulary of {vocab} but the model's vocab_size is "
            f"{model_vocab}; raise vocab_size in the model config, or prepare the data with "
            f"data.prepare.vocab_size <= {model_vocab} (and a new data.tokens)"
        )


def check_files(cfg: Config, *, need_tokens: bool = False) -> None:
    """Every input file the run reads exists (the token file may be prepared from ``data.prepare.text``)."""
    m = cfg.model
    if m.config is not None and not Path(m.config).is_file():
        raise ConfigError(f"model.config: {m.config} does not exist (a HF config.json)")
    if m.pretrained is not None:
        if not Path(m.pretrained).is_dir():
            raise ConfigError(f"model.pretrained: {m.pretrained} is not a directory (a HF model directory)")
        if not (Path(m.pretrained) / "config.json").is_file():
            raise ConfigError(f"model.pretrained: {m.pretrained} has no config.json")
    tokens = Path(cfg.data.tokens)
    if tokens.is_file():
        _token_meta(cfg)  # a file that is there must be a token file
        return
    if need_tokens or not cfg.data.prepare.text:
        raise ConfigError(
            f"data.tokens: {tokens} does not exist; make it with `hyperparallel data prepare`, or list text "
            "files in data.prepare.text so that train makes it"
        )
    for text in cfg.data.prepare.text:
        if not Path(text).is_file():
            raise ConfigError(f"data.prepare.text: {text} does not exist")
    tok = cfg.data.prepare.tokenizer
    if tok != "bpe" and not Path(tok).exists():
        raise ConfigError(
            f"data.prepare.tokenizer: {tok} does not exist; use 'bpe' to train one on the text, or a directory "
            "holding an HF tokenizer.json"
        )



def _token_meta(cfg: Config) -> dict[str, Any]:
    """``data.tokens``' metadata, its header and size checked; ConfigError naming the fix if it is no token file."""
    try:
        return read_meta(cfg.data.tokens)
    except TokenFileError as error:
        raise ConfigError(f"data.tokens: {error}") from None
