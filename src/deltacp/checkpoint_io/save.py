"""`save_pretrained`: a (sharded) model written as a transformers checkpoint directory, never whole on one device.

    save_pretrained(model, "out/hf", dtype=torch.bfloat16)      # every rank calls it; rank 0 of the model's mesh writes
    Qwen3_5ForCausalLM.from_pretrained("out/hf")                # or deltacp.load_pretrained("out/hf", mesh)

What `model.save_pretrained` writes for a model built from its config (transformers 5.25): config.json (the
transformers class, `dtype`), generation_config.json, the weights as safetensors (`model.safetensors`, or
`model-0000i-of-0000N.safetensors` of at most `max_shard_size` each with `model.safetensors.index.json`), routed
experts per expert (fused for a family whose mapping keeps them so), the family's fused tensors as one (their parts
in one file), a tied output embedding not stored (`checkpoint_io/hf_format.py`).

How: the file layout (every tensor's name, shape, dtype and offset) follows from the global shapes alone, so the
writing rank writes each header first and then the data in order, tensor by tensor; a tensor sharded on dim 0
(FSDP2) is the concatenation of its ranks' shards in rank order, so each rank sends its shard, converted to the
output dtype in row blocks of at most `block_bytes`, to the writing rank, which appends it to the file as it
arrives. Routed experts need no gathering either: expert e's gate_proj and up_proj rows are row e of
gate_up_proj, in file order. Memory: one row block in flight per rank, nowhere a whole tensor (replicated
parameters: the writing rank converts its own copy block by block).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.models.adapters import adapter_for
from deltacp.checkpoint_io.hf_format import (
    EXPERT_PARTS,
    FUSED_EXPERTS,
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    dominant_dtype,
    expert_keys,
    float_dtype,
    fused_rows,
    model_tensors,
    renamed,
    row_pieces,
    row_split,
    shard_rows,
    transformers_class,
)

BLOCK_BYTES = 256 * 2**20
_WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


@dataclass
class Entry:
    """One model tensor in the output: the stored (name, shape) pieces its rows make, in file order."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype
    pieces: list[tuple[str, tuple[int, ...]]]
    nbytes: int = 0
    joins: bool = False  # a later part of a tensor stored fused (no piece of its own: its rows follow the previous
    # entry's in the same file)


@dataclass
class OutFile:
    name: str
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0


def _entries(model: nn.Module, dtype: torch.dtype | None) -> list[Entry]:
    out = []
    family = adapter_for(model).family
    renames = family.checkpoint_renames
    for name, tensor in model_tensors(model):
        shape, to = tuple(tensor.shape), dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        stored = renamed(name, renames)
        # fused experts under a stored name of their own, or of a family that stores them fused, stay one tensor
        match = None if family.checkpoint_experts_fused else FUSED_EXPERTS.fullmatch(stored)
        rows = row_pieces(model, name)
        fused = fused_rows(model, name)
        if rows is not None:  # the family stores it in row pieces (in row order: the rows stream as they are)
            pieces = [(renamed(key, renames), (n, *shape[1:])) for key, n in rows]
        elif fused is not None:  # stored as rows of one tensor with the parameters beside it: the first part names it
            whole, first, total, place = fused
            if place and (not out or (fused_rows(model, out[-1].name) or (None,))[0] != whole):
                raise NotImplementedError(f"save_pretrained: {name} is stored fused into {whole} but does not follow "
                                          f"the tensor before it in the module's parameters")
            pieces = [] if place else [(renamed(whole, renames), (total, *shape[1:]))]
        elif match is not None and len(shape) >= 2 and shape[1] % len(EXPERT_PARTS[match["name"]]) == 0:
            rows = shape[1] // len(EXPERT_PARTS[match["name"]])  # gate_proj and up_proj split gate_up_proj's rows
            pieces = [(key, (rows, *shape[2:])) for e in range(shape[0])
                      for key in expert_keys(match["base"], match["name"], e, family.checkpoint_expert_names)]
        else:
            pieces = [(stored, shape)]
        out.append(Entry(name, tensor, to, pieces, tensor.numel() * to.itemsize,
                         joins=fused is not None and fused[3] > 0))
    return out


def _files(entries: list[Entry], max_bytes: int) -> list[OutFile]:
    """Entries in order, a new file when the next one would pass `max_bytes` (a bigger tensor gets a file alone)."""
    files: list[OutFile] = []
    for entry in entries:
        if not files or (not entry.joins and files[-1].entries and files[-1].nbytes + entry.nbytes > max_bytes):
            files.append(OutFile(""))
        files[-1].entries.append(entry)
        files[-1].nbytes += entry.nbytes
    for i, f in enumerate(files):
        f.name = SINGLE_NAME if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    return files


def _header(f: OutFile) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in f.entries:
        itemsize = entry.dtype.itemsize
        for key, shape in entry.pieces:
            n = itemsize
            for size in shape:
                n *= size
            header[key] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + n]}
            offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _row_blocks(rows: int, row_bytes: int, block_bytes: int) -> list[tuple[int, int]]:
    step = max(1, block_bytes // max(1, row_bytes))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def _group_of(entries: list[Entry]):
    """The process group of the model's shards (the mesh of its DTensors), the world for replicated parameters,
    None without a process group."""
    from torch.distributed.tensor import DTensor

    meshes = {id(e.tensor.device_mesh): e.tensor.device_mesh for e in entries if isinstance(e.tensor, DTensor)}
    if len(meshes) > 1:
        raise NotImplementedError("save_pretrained: the model's DTensors live on different meshes")
    if meshes:
        return next(iter(meshes.values())).get_group()
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class _Writer:
    """The writing rank's files: the first OSError (disk full, a file that cannot be created) is kept and every later
    write dropped, so that the rank goes on receiving the other ranks' blocks (they would wait in their sends) and
    every rank raises it together after the stream."""

    def __init__(self, out: Path):
        self.out, self.error, self.handle = out, None, None

    def _try(self, fn, *args):
        if self.error is None:
            try:
                return fn(*args)
            except OSError as exc:
                self.error = exc
        return None

    def open(self, name: str) -> None:
        self.close()
        self.handle = self._try(open, self.out / name, "wb")

    def write(self, data) -> None:
        if self.handle is not None:
            self._try(self.handle.write, data)

    def close(self) -> None:
        if self.handle is not None:
            self._try(self.handle.close)
            self.handle = None


def _stream(files: list[OutFile], writer: _Writer | None, group, block_bytes: int) -> None:
    """Every rank sends its shard of every entry, block by block, to group rank 0, which writes the files
    (`writer`: rank 0's; None on the others)."""
    rank = 0 if group is None else dist.get_rank(group)
    for f in files:
        if rank == 0:
            writer.open(f.name)
            writer.write(_header(f))
        for entry in f.entries:
            _stream_entry(entry, writer, rank, group, block_bytes)
    if rank == 0:
        writer.close()


@torch.no_grad()
def _stream_entry(entry: Entry, handle, rank: int, group, block_bytes: int) -> None:
    """One entry's rows in order: each holder's shard in holder order (one holder: the writer's own copy)."""
    local, _, holders = row_split(entry.tensor)
    shape = tuple(entry.tensor.shape) or (1,)
    local = local.detach().reshape(-1, *shape[1:])
    row_bytes = entry.dtype.itemsize * math.prod(shape[1:])
    for r in range(holders):
        rows = shard_rows(shape[0], holders, r)[0] if holders > 1 else shape[0]
        for a, b in _row_blocks(rows, row_bytes, block_bytes):
            if r == rank:
                block = local[a:b].to(entry.dtype).contiguous()
                if rank != 0:
                    dist.send(block, group=group, group_dst=0)
                    continue
            elif rank == 0:
                block = torch.empty((b - a, *shape[1:]), dtype=entry.dtype, device=local.device)
                dist.recv(block, group=group, group_src=r)
            else:
                continue
            handle.write(block.cpu().reshape(-1).view(torch.uint8).numpy())


def _together(group, what: str, checks: LocalChecks) -> None:
    if group is not None:
        raise_together(group, what, checks.error)
    elif checks.error is not None:
        raise checks.error


def save_pretrained(model: nn.Module, path, *, dtype: torch.dtype | str | None = None,
                    max_shard_size: int | str = "50GB", block_bytes: int = BLOCK_BYTES) -> Path:
    """Write `model` (any supported class; FSDP2-sharded, replicated or on one process) as a transformers
    checkpoint directory `path` (see the module docstring); every rank holding a shard calls this, rank 0 of the
    model's mesh writes. dtype: the stored floating dtype, a torch dtype or its name (float32, bfloat16, float16,
    float64; None: each parameter's own, e.g. float32 master weights). Returns `path`.

    Atomic: the new export is written to a staging directory beside `path` (`.NAME.staging-*`; beside its target
    where `path` is a symlink, which stays one) and swapped in only when complete, so an earlier export in `path`
    stays loadable until then, whatever happens to the ranks (a staging directory a killed save left is removed by
    the next save to `path`). What `path` held besides the weights, the index and the configs (a tokenizer, say) is
    carried over, as `model.save_pretrained`, writing in place, leaves it. Errors (a bad dtype; a path the writing
    rank, the only one that touches the file system, cannot create or write; a write that fails on it, a full disk
    included) are raised on every rank together; then `path` is as it was and no staging directory is left. Not
    covered: a rank that dies or fails outside the file writes mid-save leaves the others waiting in the stream
    until the process group's timeout (`path` is unchanged then too)."""
    out = Path(path)
    target = out.resolve()  # (a symlinked export directory: its target is replaced, the link kept)
    group = _group_of(_entries(model, None))
    rank = 0 if group is None else dist.get_rank(group)
    files = entries = writer = staging = None
    with LocalChecks() as checks:
        dtype = None if dtype is None else float_dtype(dtype, "save_pretrained: dtype",
                                                       also=" or None (each parameter's own)")
        entries = _entries(model, dtype)
        files = _files(entries, _shard_bytes(max_shard_size))
        unsupported = sorted({str(e.dtype) for e in entries if e.dtype not in SAFETENSORS_DTYPES})
        if unsupported:
            raise ValueError(f"save_pretrained: no safetensors dtype for {unsupported}")
    if checks.error is None and rank == 0:
        with LocalChecks(OSError) as checks:
            staging = _staging_dir(target)
            writer = _Writer(staging)
    try:
        _together(group, "save_pretrained", checks)
        _stream(files, writer, group, block_bytes)
        with LocalChecks(OSError) as checks:
            if rank == 0:
                _finish(model, staging, writer, files, entries, dtype)
                _swap_in(staging, target)
        _together(group, "save_pretrained", checks)  # (also: no rank returns before the directory is complete)
    finally:  # a failed save leaves no staging directory (a swapped-in one is gone already)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _shard_bytes(max_shard_size) -> int:
    """`max_shard_size` in bytes (an int, or a string as transformers takes it: "5GB", "500MiB"); ValueError naming
    the setting otherwise (transformers' own names `size`, or is an AttributeError for None)."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(max_shard_size)
    except (ValueError, TypeError, AttributeError):
        size = None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"save_pretrained: max_shard_size={max_shard_size!r} is not supported; expected a positive "
                         f"number of bytes or a size string such as '5GB' or '500MiB'")
    return size


def _finish(model: nn.Module, staging: Path, writer: _Writer, files: list[OutFile], entries: list[Entry],
            dtype: torch.dtype | None) -> None:
    """After the stream, on the writing rank: its first write error, else the index (several files) and configs."""
    if writer.error is not None:
        raise writer.error
    if len(files) > 1:
        weight_map = {key: f.name for f in files for e in f.entries for key, _ in e.pieces}
        index = {"metadata": {"total_parameters": sum(e.tensor.numel() for e in entries),
                              "total_size": sum(f.nbytes for f in files)}, "weight_map": weight_map}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _write_configs(model, staging, entries, dtype)


def _staging_dir(out: Path) -> Path:
    """A new empty directory beside `out` to write the export into (same file system: renames are atomic). What
    earlier saves to `out` that were killed left is cleared first: their staging directories are removed; an old
    export a save moved aside (`_swap_in` without an exchange) goes back to `out` if `out` is missing (killed between
    the two renames), else is removed. OSError when `out` is a file or its parent cannot be written."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"save_pretrained: {out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    for aside in out.parent.glob(f".{out.name}.old-*"):
        if not out.exists() and (aside / out.name).is_dir():
            os.rename(aside / out.name, out)
        shutil.rmtree(aside, ignore_errors=True)
    for stale in out.parent.glob(f".{out.name}.staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # (mkdtemp's 0700 would become the export's mode)
    return staging


def _swap_in(staging: Path, out: Path) -> None:
    """Make `staging` the directory `out`: first the files of an earlier `out` that are not weights, the index or
    configs the new export writes are linked (or copied) into it; then one atomic exchange of the two directories
    (renameat2 RENAME_EXCHANGE, Linux), or where the file system lacks it (NFS, say) two renames (a kill between
    them leaves the old export whole in `.NAME.old-*`, put back by the next save); the old directory is removed
    last."""
    if not out.exists():
        os.rename(staging, out)
        return
    written = {p.name for p in staging.iterdir()}
    for old in out.iterdir():
        if old.name in written or _WEIGHT_FILES.fullmatch(old.name) or old.name == INDEX_NAME:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.copytree(old, staging / old.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(old, staging / old.name)
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # (now the old export)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old / out.name)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(old / out.name, out)  # put back whole; the caller removes the staging directory
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 with RENAME_EXCHANGE); False where unavailable."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _write_configs(model: nn.Module, out: Path, entries: list[Entry], dtype: torch.dtype | None) -> None:
    """config.json (the transformers class, the stored dtype) and generation_config.json, as save_pretrained."""
    config = copy.deepcopy(model.config)
    config.architectures = [transformers_class(model).__name__]
    if dtype is None:  # the dtype most of the stored bytes have
        dtype = dominant_dtype((e.dtype, e.nbytes) for e in entries)
    config.dtype = dtype
    config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(out)
