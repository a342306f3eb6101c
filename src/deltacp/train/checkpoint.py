"""Atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout: `<dir>/step_00000050/` holds the DCP shards of the model and optimizer (sharded FSDP2 state, any
world size can load it) and `trainer_rank{r}.pt` per rank (step, scheduler, data position, RNG states).
Every rank writes into `<dir>/step_00000050.tmp/`; after all ranks have finished, rank 0 renames it to its
final name. A rename is atomic, so a crash while saving leaves only a `.tmp` directory, which loading
ignores (and the next save on rank 0 removes): a checkpoint either loads completely or is not there.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / ".metadata").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: str | Path, step: int, model, optimizer, trainer_state: dict, keep: int = 0,
                    before_commit=None) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    root = Path(root)
    rank = dist.get_rank()
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save({**trainer_state, "rng": rng_state()}, tmp / f"trainer_rank{rank}.pt")
    dist.barrier()
    if before_commit is not None:
        before_commit(step)  # test hook: a crash here must leave no loadable checkpoint
    if rank == 0:
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        if keep:
            for _, old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, model, optimizer) -> dict:
    """Collective. Loads model and optimizer in place, sets this rank's RNG, returns its trainer state."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank_file = path / f"trainer_rank{dist.get_rank()}.pt"
    if not rank_file.is_file():
        raise RuntimeError(f"checkpoint {path} has no {rank_file.name}: it was written by fewer ranks than this run "
                           f"has ({dist.get_world_size()}); resume with the same cp")
    trainer_state = torch.load(rank_file, weights_only=False)
    set_rng_state(trainer_state.pop("rng"))
    return trainer_state


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
