"""Atomic, verified, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of a checkpoint directory `dir` (train.checkpoint.dir):

    dir/run.json                    the run that owns dir: run_id, start time, host, pid
    dir/step_00000050/.metadata     DCP: the model and optimizer state (sharded FSDP2 state)
    dir/step_00000050/__R_0.distcp  DCP shards, one per saving rank
    dir/step_00000050/trainer_rankR.pt   step, scheduler, data position, RNG state of rank R
    dir/step_00000050/manifest.json run_id, step, world size, and the size and sha256 of every file above

Saving: every rank writes into `step_00000050.tmp/`; the ranks hash the files (each a share of them) and rank 0
writes manifest.json there; after all ranks have finished, rank 0 renames the directory to its final name. A
rename is atomic, so a crash while saving leaves only a `.tmp` directory, which loading ignores (and the next
save on rank 0 removes): a checkpoint either loads completely or is not there. Retention (`keep`) deletes
only checkpoints whose manifest names this run.

Loading verifies every file against the manifest first (a truncated or flipped file is an error naming it),
then loads. The newest committed `step_N` directory is the one resumed: if it lacks `.metadata` it is damaged,
an error like any other damage (`newest_checkpoint`), never skipped for an older checkpoint. Any world size can load a checkpoint: DCP reshards the model and optimizer state, and the
per-rank trainer state (identical on every rank except the RNG state, and every rank's RNG is seeded alike)
of rank r comes from `trainer_rank{r % saved_world}.pt`. So a run saved at cp=2 resumes at cp=4 and back, and
one saved at dp1 x cp4 at dp2 x cp2: the data position in it is global (every rank reads the whole global batch).

Failures are `CheckpointError`: one line naming the file (or the checkpoint directory) and the cause, raised
alike on every rank (DCP's CheckpointException is unwrapped to the first failing rank's exception).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from deltacp.train.config import first_line

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
RUN_FILE = "run.json"
_MODEL_MISMATCH = re.compile(r"size mismatch|missing key|unexpected key|shape", re.IGNORECASE)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: one line naming the file and the cause (same on every rank)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint directory (step_NNNNNNNN, not .tmp) under root, oldest first,
    whether or not its files are all there."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(match.group(1)), child) for child in root.iterdir()
                  if (match := _STEP_DIR.match(child.name)) and child.is_dir())


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint (one with DCP's .metadata) under root, oldest first."""
    return [(step, path) for step, path in checkpoint_dirs(root) if (path / ".metadata").is_file()]


def newest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """(step, path) of the newest checkpoint under root, or None if there is none.

    A committed step_N directory is renamed into place only once all of its files are written, so one without
    .metadata has been damaged since: like any other damaged checkpoint it is an error (CheckpointError naming
    it), never skipped for an older one that the run would then resume and overwrite."""
    found = checkpoint_dirs(root)
    if not found:
        return None
    step, path = found[-1]
    if not (path / ".metadata").is_file():
        older = [p for _, p in found[:-1] if (p / ".metadata").is_file()]
        instead = f", or delete it to resume from {older[-1]}" if older else ", or delete it to start over"
        raise CheckpointError(f"checkpoint file {path / '.metadata'} is missing (the newest checkpoint in "
                              f"{Path(root)} is damaged: DCP's index of its model and optimizer state is gone); "
                              f"restore it{instead}")
    return step, path


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------------------------
# Run identity, manifests, checksums
# ---------------------------------------------------------------------------------------------------------------


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def read_json(path: Path) -> dict | None:
    """The JSON object in path, or None if the file is missing; unreadable JSON raises CheckpointError."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {first_line(exc)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: unreadable (not a JSON object)")
    return data


def write_json_atomic(path: Path, data: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def run_owner(root: str | Path) -> dict | None:
    """The identity in root/run.json (the run that owns the checkpoint directory), or None."""
    return read_json(Path(root) / RUN_FILE)


def claim_directory(root: str | Path, run_id: str, resumed_from: str | None) -> str:
    """Rank 0: record this process as the owner of the checkpoint directory root, running `run_id`; returns the
    claim's session id (new for every start, so two processes resuming the same run are told apart)."""
    root = Path(root)
    session = uuid.uuid4().hex
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(root / RUN_FILE, dict(run_id=run_id, session=session,
                                                started=time.strftime("%Y-%m-%d %H:%M:%S"), host=socket.gethostname(),
                                                pid=os.getpid(), resumed_from=resumed_from))
    except OSError as exc:
        raise CheckpointError(f"train.checkpoint.dir={str(root)!r} cannot be written ({type(exc).__name__}: "
                              f"{exc.strerror or first_line(exc)}): choose a writable directory") from None
    return session


def checkpoint_run_id(path: str | Path) -> str | None:
    """The run id in a checkpoint's manifest (None if it has none or it is unreadable)."""
    try:
        manifest = read_json(Path(path) / MANIFEST)
    except CheckpointError:
        return None
    return None if manifest is None else manifest.get("run_id")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _share(names: list[str]) -> list[str]:
    """This rank's share of the files to hash."""
    return names[dist.get_rank()::dist.get_world_size()]


def _hash_files(directory: Path, names: list[str]) -> dict:
    """Collective: {name: {bytes, sha256}} of every file in names, each rank hashing a share."""
    mine = {name: dict(bytes=(directory / name).stat().st_size, sha256=_sha256(directory / name))
            for name in _share(names)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: entry for part in gathered for name, entry in part.items()}


def _check_file(directory: Path, name: str, expected: dict, checksum: bool = True) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"checkpoint file {path} is missing (listed in {MANIFEST})"
    size = path.stat().st_size
    if size != expected["bytes"]:
        kind = "truncated" if size < expected["bytes"] else "longer than saved"
        return f"checkpoint file {path} is {kind}: {size} bytes, {MANIFEST} says {expected['bytes']}"
    if not checksum:
        return None
    digest = _sha256(path)
    if digest != expected["sha256"]:
        return (f"checkpoint file {path} is corrupted: sha256 {digest[:16]}..., {MANIFEST} says "
                f"{expected['sha256'][:16]}...")
    return None


def _read_manifest(path: Path) -> dict:
    manifest = read_json(path / MANIFEST)
    if manifest is None:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}, so it cannot be verified (saved by a deltacp "
                              f"without checksums, or not by deltacp)")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{path / MANIFEST}: unreadable (no file list)")
    return manifest


def precheck_checkpoint(path: str | Path) -> dict:
    """Without a process group (before any rank starts): the checkpoint's manifest is readable and every file it
    lists is there with its size; returns the manifest, or raises CheckpointError naming the first bad file. The
    checksums are left to `verify_checkpoint` (collective, when the ranks load it)."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name in sorted(manifest["files"]):
        error = _check_file(path, name, manifest["files"][name], checksum=False)
        if error:
            raise CheckpointError(error)
    return manifest


def model_mismatch(checkpoint: str | Path, shapes: dict) -> str | None:
    """How the model state of `checkpoint` differs from a model with these {name: shape} (transformers' own
    names, as get_model_state_dict gives them), e.g. "it lacks lm_head.weight (1 missing, ...)"; None if it fits.
    Reads only DCP's .metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as exc:  # noqa: BLE001
        raise load_failure(Path(checkpoint), exc, "load") from None
    saved = {key.removeprefix("model."): getattr(meta, "size", None)
             for key, meta in metadata.state_dict_metadata.items() if key.startswith("model.")}
    missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    other = [key for key in sorted(shapes) if key in saved and tuple(saved[key] or ()) != tuple(shapes[key])]
    if not (missing or extra or other):
        return None
    if other:
        first = f"has {other[0]} of shape {list(saved[other[0]])}, this model {list(shapes[other[0]])}"
    else:
        first = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which this model lacks"
    return f"it {first} ({len(missing)} missing, {len(extra)} extra, {len(other)} other-shaped weights)"


def verify_checkpoint(path: str | Path) -> dict:
    """Collective: check every file of the checkpoint against its manifest (each rank a share of the files);
    returns the manifest, or raises CheckpointError naming the first bad file on every rank."""
    path = Path(path)
    try:
        manifest = _read_manifest(path)
        files = manifest["files"]
        errors = [e for e in (_check_file(path, name, files[name]) for name in _share(sorted(files))) if e]
    except CheckpointError as exc:
        errors = [str(exc)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    errors = sorted(e for part in gathered for e in part)
    if errors:
        raise CheckpointError(errors[0])
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------------------------


def unwrap_checkpoint_exception(exc: BaseException) -> BaseException:
    """DCP's CheckpointException -> the exception of its lowest failing rank (itself otherwise)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        cause = failures[min(failures)]
        return cause[0] if isinstance(cause, tuple) else cause
    return exc


def load_failure(path: Path, exc: BaseException, action: str) -> CheckpointError:
    """The one-line CheckpointError for a failed DCP save or load of `path` (`action`: save | load), naming the
    first failing rank's exception; a model mismatch says what to do."""
    cause = unwrap_checkpoint_exception(exc)
    text = f"{type(cause).__name__}: {first_line(cause)}"
    hint = ""
    if action == "load" and _MODEL_MISMATCH.search(text):
        hint = (" (this model or optimizer differs from the run that saved it; resuming needs the same train.model: "
                "point train.checkpoint.dir to a fresh directory to start over)")
    return CheckpointError(f"checkpoint {path}: {action} failed: {text}{hint}")


def save_checkpoint(root: str | Path, step: int, model, optimizer, trainer_state: dict, keep: int = 0,
                    before_commit=None, run_id: str | None = None, session: str | None = None) -> Path:
    """Collective: every rank calls it. Returns the final directory.

    The manifest records `run_id`; retention (`keep`) deletes only older checkpoints of that run. With `session`
    (from claim_directory), the save refuses (CheckpointError, every rank) once root/run.json holds another
    claim: another process has taken the directory over since (two runs writing one directory)."""
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
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    except CheckpointException as exc:
        raise load_failure(tmp, exc, "save") from None
    torch.save({**trainer_state, "rng": rng_state()}, tmp / f"trainer_rank{rank}.pt")
    dist.barrier()
    files = _hash_files(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file()))
    problem = [None]
    if rank == 0:
        owner = run_owner(root) if session is not None else None
        if owner is not None and owner.get("session") != session:
            problem[0] = (f"train.checkpoint.dir {root} was claimed by another process since this run started (run "
                          f"{owner.get('run_id')}, pid {owner.get('pid')} on {owner.get('host')}, "
                          f"{owner.get('started')}): two runs write to one directory; not saving step {step}")
        else:
            write_json_atomic(tmp / MANIFEST, dict(format=1, run_id=run_id, step=step,
                                                   world_size=dist.get_world_size(), files=files))
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])
    if before_commit is not None:
        before_commit(step)  # test hook: a crash here must leave no loadable checkpoint
    if rank == 0:
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        if keep:
            own = [p for _, p in complete_checkpoints(root) if checkpoint_run_id(p) == run_id]
            for old in own[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, model, optimizer) -> dict:
    """Collective. Verifies the checkpoint, loads model and optimizer in place (resharded to this world size),
    sets this rank's RNG, returns its trainer state (with `manifest`: the checkpoint's manifest)."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (CheckpointException, Exception) as exc:  # noqa: BLE001  (CheckpointException is a BaseException)
        raise load_failure(path, exc, "load") from None
    saved_world = int(manifest.get("world_size") or dist.get_world_size())
    rank_file = path / f"trainer_rank{dist.get_rank() % saved_world}.pt"
    try:
        trainer_state = torch.load(rank_file, weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint file {rank_file}: load failed: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    set_rng_state(trainer_state.pop("rng"))
    trainer_state["manifest"] = manifest
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
