"""What can be checked before any rank starts: the model against the CP layout, the data, the tokenizer and the
checkpoint directory.

    preflight(cfg, spawn=True)    # python -m deltacp.train --spawn N: in the launcher, before spawning
    preflight(cfg, spawn=False)   # torchrun: on every rank, before its process group exists

train.activation_checkpointing=auto on CPU needs a budget in GiB. The model is built on the meta device (shapes only) and every decoder layer is put through the checks
`parallelize_cp` runs on it (the GDN style's `check_module`, `check_attention_module`), so e.g.
full_attention_cp=ulysses with num_attention_heads not divisible by cp is one line before any rank starts. The
data files are checked for existence, readability and the format of their first record, and for a document that
gives the model a target (read in order until one does: no second pass over the corpus); the tokenizer is loaded;
train.checkpoint.dir must be a writable directory (or creatable), and what it holds is judged as the ranks would
(`plan_checkpoint_dir`): the checkpoint to resume must have its manifest, every file it lists at its size, a
model state of this model's shapes and this run's data stream (seed, number of files); the checksums are verified
by the ranks, collectively, when they load it. train.logging.metrics_file, when set, must be a file whose directory
is writable or can be created.

Errors are ConfigError (naming the key) or CheckpointError (naming the file); the ranks run their own checks
again, so a Trainer built without the launcher refuses the same things, on every rank together.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from deltacp.config import AcceleratorConfig
from deltacp.train.checkpoint import CheckpointError, model_mismatch, precheck_checkpoint
from deltacp.train.config import ConfigError, TrainConfig, first_line
from deltacp.train.data import check_files, check_trainable_text, listed_files, make_tokenizer, stdlib_files


def check_cp_layers(model: torch.nn.Module, acc: AcceleratorConfig) -> None:
    """Every decoder layer of `model` (any device, meta too) through the checks parallelize_cp runs on it at
    train.accelerator's settings (the same function); ConfigError naming the layer, the settings and the rule."""
    from deltacp.models.adapters import adapter_for
    from deltacp.models.parallelize import check_model

    settings = f"train.accelerator ({acc.plan.describe()})"
    try:
        linear, full = acc.plan.styles()
        check_model(model, adapter_for(model), linear, full, acc.cp)
    except (ValueError, NotImplementedError, ImportError) as exc:
        raise ConfigError(f"train.model ({type(model).__name__}) with {settings}: {exc}") from None


def check_data(cfg: TrainConfig) -> tuple[int, int]:
    """The tokenizer loads and the data files are readable, well formed (first record) and give a target; returns
    the tokenizer's vocabulary size and the number of data files."""
    tokenizer = make_tokenizer(cfg.data)
    if cfg.data.source == "files":
        files = listed_files(cfg.data.paths)
        check_files(files, cfg.data)
        check_trainable_text(files, cfg.data, tokenizer)
    else:
        files = stdlib_files()
    return tokenizer.vocab_size, len(files)


def _unwritable(path: Path) -> str | None:
    """Why `path` is neither a writable directory nor creatable as one (its nearest existing ancestor must be a
    writable directory), or None. Creates nothing."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return "is not a directory" if existing == path else f"cannot be created: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        return f"{where} (permission denied or a read-only file system); choose a writable directory"
    return None


def check_writable_dir(key: str, path: str | Path) -> None:
    """`path` is a writable directory, or can be created as one; ConfigError naming the key and the path
    otherwise. Creates nothing."""
    problem = _unwritable(Path(path))
    if problem:
        raise ConfigError(f"{key}={str(path)!r} {problem}")


def check_metrics_file(cfg: TrainConfig) -> None:
    """train.logging.metrics_file, when set, is a file that rank 0 can append to: not a directory, in a directory
    that is writable or can be created (rank 0 creates it). ConfigError naming the key otherwise."""
    path = cfg.logging.metrics_file
    if not path:
        return
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"train.logging.metrics_file={str(path)!r} is a directory; name a file (JSON lines)")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"train.logging.metrics_file={str(path)!r} is not writable (permission denied or a "
                          f"read-only file system)")
    problem = _unwritable(path.parent)
    if problem:
        raise ConfigError(f"train.logging.metrics_file={str(path)!r}: its directory {path.parent} {problem}")


def check_checkpoint_dir(cfg: TrainConfig, model: torch.nn.Module, num_files: int) -> None:
    """train.checkpoint.dir is writable, and what it holds is usable by this run (see the module doc): the
    checkpoint to resume fits `model` and this run's data stream (train.seed, `num_files` data files)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from deltacp.train.trainer import plan_checkpoint_dir

    if not cfg.checkpoint.dir:
        return
    check_writable_dir("train.checkpoint.dir", cfg.checkpoint.dir)
    plan = plan_checkpoint_dir(cfg)
    if plan["error"]:
        raise ConfigError(plan["error"])
    if plan["damaged"]:
        raise CheckpointError(plan["damaged"])
    if plan["resume"] is None:
        return
    path = Path(plan["resume"])
    precheck_checkpoint(path)
    shapes = {key: tuple(value.shape) for key, value in get_model_state_dict(model).items()}
    mismatch = model_mismatch(path, shapes)
    if mismatch:
        raise CheckpointError(f"checkpoint {path} does not fit train.model of this config: {mismatch}; resuming "
                              f"needs the same train.model: point train.checkpoint.dir to a fresh directory to start "
                              f"over")
    rank_file = path / "trainer_rank0.pt"
    try:
        stream = torch.load(rank_file, weights_only=False).get("data") or {}
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint file {rank_file}: load failed: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    if (stream.get("seed"), stream.get("num_files")) != (cfg.seed, num_files):
        raise CheckpointError(f"checkpoint {path} does not fit train.seed / train.data of this config: its data stream "
                              f"is seed {stream.get('seed')} over {stream.get('num_files')} files, this config's seed "
                              f"{cfg.seed} over {num_files}; resuming needs the same seed and data: point "
                              f"train.checkpoint.dir to a fresh directory to start over")


def preflight(cfg: TrainConfig, spawn: bool) -> None:
    """Every check of the module doc; `spawn`: the ranks will be gloo ranks spawned here (else torchrun's)."""
    from deltacp.train.trainer import (backend_for, check_device_backend, check_vocab, checkpointing_budget, device_type,
                                       model_skeleton)

    device = device_type(cfg)
    check_device_backend(cfg, device, "gloo" if spawn else backend_for(cfg, device))
    try:
        model = model_skeleton(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001  (transformers: OSError, ValueError, ... for an unusable directory)
        if cfg.model.pretrained is None:
            raise
        raise ConfigError(f"train.model.pretrained={cfg.model.pretrained!r}: no model config could be read from "
                          f"this directory ({type(exc).__name__}: {first_line(exc)[:300]})") from None
    if cfg.activation_checkpointing == "auto" and device != "cuda":  # a budget in GiB needed: no device memory
        checkpointing_budget(cfg, torch.device(device))
    check_cp_layers(model, cfg.accelerator)
    vocab_size, num_files = check_data(cfg)
    check_vocab(model.config, vocab_size)
    check_checkpoint_dir(cfg, model, num_files)
    check_metrics_file(cfg)
