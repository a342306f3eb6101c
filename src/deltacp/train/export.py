"""Export a trained checkpoint as a transformers directory (save_pretrained layout, safetensors).

    python -m deltacp.train.export --config configs/tiny_cp4.yaml --checkpoint runs/x/ckpt --out runs/x/hf
    python -m deltacp.train.export --config run.yaml --checkpoint runs/x/ckpt/step_00000200 --out hf --dtype bfloat16

`--checkpoint` is one checkpoint (`dir/step_N`) or a checkpoint directory (its newest complete checkpoint);
without it, train.checkpoint.dir of the config. The single-device model is built from `train.model` of the
run's config (Qwen3_5TextConfig fields or a local pretrained directory) on the CPU, the checkpoint is verified
against its manifest and its model state loaded (DCP reshards: any world size / CP degree it was saved at; the
optimizer state is not read), and `deltacp.save_pretrained` writes what `model.save_pretrained` writes
(config.json, generation_config.json, model.safetensors; above --max-shard-size, model-0000i-of-0000N.safetensors
with their index), converting one block of one tensor at a time to --dtype (no second copy of the model), so
`Qwen3_5ForCausalLM.from_pretrained(out)` reloads it with the trained model's logits. A local Hugging Face tokenizer (train.data.tokenizer) is written alongside; the byte
tokenizer has no files (token id = byte value). `train.model: {pretrained: out}` trains from the export.

The directory is written as `out.partial-PID` and renamed to `out` when complete; the `out.partial-PID` left by an
export that was killed (its process gone) is removed by the next export to `out`. Errors are one line naming
the setting (exit 2: config, arguments, output directory; exit 1: the checkpoint).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from deltacp.checkpoint_io.save import save_pretrained
from deltacp.train.checkpoint import (
    CheckpointError,
    load_failure,
    model_mismatch,
    newest_checkpoint,
    verify_checkpoint,
)
from deltacp.train.config import ConfigError, TrainConfig, load_config

logger = logging.getLogger(__name__)


class ExportError(ValueError):
    """A bad export argument (--out, --checkpoint, --dtype): one line naming it."""


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_checkpoint(cfg: TrainConfig, checkpoint: str | Path | None) -> Path:
    """One checkpoint directory (step_N, with DCP's .metadata) from --checkpoint or train.checkpoint.dir."""
    if checkpoint is None:
        if not cfg.checkpoint.dir:
            raise ExportError("--checkpoint is not given and train.checkpoint.dir is null: name a checkpoint "
                              "(dir/step_N) or a checkpoint directory")
        checkpoint, name = cfg.checkpoint.dir, "train.checkpoint.dir"
    else:
        name = "--checkpoint"
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"{name}={str(path)!r}: no such directory")
    if (path / ".metadata").is_file():
        return path
    newest = newest_checkpoint(path)  # a damaged newest one is an error, not skipped for an older one
    if newest is None:
        raise CheckpointError(f"{name}={str(path)!r} is neither a checkpoint (no .metadata) nor a directory holding "
                              f"complete checkpoints (step_NNNNNNNN; .tmp ones are incomplete)")
    return newest[1]


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        kind = "a directory that is not empty" if out.is_dir() else "not a directory"
        raise ExportError(f"--out={str(out)!r} is {kind}: exports never overwrite; choose a new directory")


def _one_rank_group() -> bool:
    """verify_checkpoint is collective: a one-rank gloo group unless one exists (True if created here)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"export runs in one process; this process group has {dist.get_world_size()} ranks")
        return False
    from deltacp.distributed.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(minutes=30))
    return True


def load_trained_model(cfg: TrainConfig, checkpoint: Path) -> tuple[torch.nn.Module, dict]:
    """The single-device transformers model of `cfg` with the model state of `checkpoint` (verified against its
    manifest; resharded from any world size); returns (model, manifest). Needs a (one-rank) process group."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from deltacp.train.data import make_tokenizer
    from deltacp.train.trainer import build_model

    manifest = verify_checkpoint(checkpoint)
    model = build_model(cfg, make_tokenizer(cfg.data).vocab_size)
    state = get_model_state_dict(model)  # transformers' own names (wrappers are never in the checkpoint keys)
    mismatch = model_mismatch(checkpoint, {key: tuple(value.shape) for key, value in state.items()})
    if mismatch:
        raise CheckpointError(f"checkpoint {checkpoint} does not fit train.model of this config: {mismatch}; "
                              f"export with the run's config")
    try:
        container = {"model": state}
        load(container, checkpoint_id=str(checkpoint))
        set_model_state_dict(model, container["model"])
    except BaseException as exc:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise load_failure(checkpoint, exc, "load") from None
    return model.eval(), manifest


def _remove_stale_partials(out: Path) -> None:
    """Delete the `out.partial-PID` directories of earlier exports to `out` whose process no longer runs on this
    machine (killed mid-write: SIGKILL, a crash); a live one (another export writing now) is left alone."""
    for partial in out.parent.glob(f"{out.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            logger.warning("removing %s, left by export process %s, which no longer runs", partial, pid)
            shutil.rmtree(partial, ignore_errors=True)
        except PermissionError:  # a live process of another user
            pass


def export_checkpoint(cfg: TrainConfig, out: str | Path, checkpoint: str | Path | None = None,
                      dtype: str | None = None, max_shard_size: int | str = "50GB") -> Path:
    """Write the checkpoint's model as a transformers directory `out` (see the module doc); returns out.
    dtype: float32 | bfloat16 | float64; default float32 (float64 for a float64 run). max_shard_size: the largest
    safetensors file (e.g. "5GB"); a bigger model is split into model-0000i-of-0000N.safetensors + index."""
    out = Path(out)
    dtype = dtype or ("float64" if cfg.dtype == "float64" else "float32")
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype={dtype!r} is not supported; expected one of {list(EXPORT_DTYPES)}")
    _check_out(out)
    path = resolve_checkpoint(cfg, checkpoint)
    created = _one_rank_group()
    try:
        model, manifest = load_trained_model(cfg, path)
    finally:
        if created:
            dist.destroy_process_group()
    _remove_stale_partials(out)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_pretrained(model, partial, dtype=EXPORT_DTYPES[dtype], max_shard_size=max_shard_size)
        if cfg.data.tokenizer != "bytes":
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(cfg.data.tokenizer, local_files_only=True).save_pretrained(partial)
        _check_out(out)
        if out.exists():
            out.rmdir()
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deltacp.train.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's trainer YAML (its train.model builds the model)")
    parser.add_argument("--set", action="append", default=[], metavar="train.KEY=VALUE",
                        help="override one config value (YAML syntax), repeatable")
    parser.add_argument("--checkpoint", default=None,
                        help="dir/step_N, or a checkpoint directory (its newest checkpoint); default: "
                             "train.checkpoint.dir")
    parser.add_argument("--out", required=True, help="new (or empty) output directory")
    parser.add_argument("--dtype", choices=list(EXPORT_DTYPES), default=None,
                        help="weights dtype (default float32; float64 for a float64 run)")
    parser.add_argument("--max-shard-size", default="50GB",
                        help="largest safetensors file, e.g. 5GB (default 50GB, as save_pretrained)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        checkpoint = resolve_checkpoint(cfg, args.checkpoint)
        out = export_checkpoint(cfg, args.out, checkpoint, args.dtype, args.max_shard_size)
    except (ConfigError, ExportError, OSError, ValueError) as exc:
        print(f"deltacp.train.export: {'config error: ' if isinstance(exc, ConfigError) else ''}"
              f"{_one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except CheckpointError as exc:
        print(f"deltacp.train.export: {_one_line(exc)}", file=sys.stderr)
        sys.exit(1)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"deltacp.train.export: wrote {out} ({files}) from {checkpoint}")


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


if __name__ == "__main__":
    main()
