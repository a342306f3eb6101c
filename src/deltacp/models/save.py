"""`save_pretrained`: a (sharded) model written as a transformers checkpoint directory, never whole on one device.

    save_pretrained(model, "out/hf", dtype=torch.bfloat16)      # every rank calls it; rank 0 of the model's mesh writes
    Qwen3_5ForCausalLM.from_pretrained("out/hf")                # or deltacp.load_pretrained("out/hf", mesh)

What `model.save_pretrained` writes for a model built from its config (transformers 5.25): config.json (the
transformers class, `dtype`), generation_config.json, the weights as safetensors (`model.safetensors`, or
`model-0000i-of-0000N.safetensors` of at most `max_shard_size` each with `model.safetensors.index.json`), routed
experts per expert (`models/hf_format.py`), a tied output embedding not stored.

How: the file layout (every tensor's name, shape, dtype and offset) follows from the global shapes alone, so the
writing rank writes each header first and then the data in order, tensor by tensor; a tensor sharded on dim 0
(FSDP2) is the concatenation of its ranks' shards in rank order, so each rank sends its shard, converted to the
output dtype in row blocks of at most `block_bytes`, to the writing rank, which appends it to the file as it
arrives. Routed experts need no gathering either: expert e's gate_proj and up_proj rows are row e of
gate_up_proj, in file order. Memory: one row block in flight per rank, nowhere a whole tensor (replicated
parameters: the writing rank converts its own copy block by block).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.models.hf_format import (
    EXPERT_PARTS,
    FUSED_EXPERTS,
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    dominant_dtype,
    expert_keys,
    model_tensors,
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


@dataclass
class OutFile:
    name: str
    entries: list[Entry] = field(default_factory=list)
    nbytes: int = 0


def _entries(model: nn.Module, dtype: torch.dtype | None) -> list[Entry]:
    out = []
    for name, tensor in model_tensors(model):
        shape, to = tuple(tensor.shape), dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        match = FUSED_EXPERTS.fullmatch(name)
        if match is not None and len(shape) >= 2 and shape[1] % len(EXPERT_PARTS[match["name"]]) == 0:
            rows = shape[1] // len(EXPERT_PARTS[match["name"]])  # gate_proj and up_proj split gate_up_proj's rows
            pieces = [(key, (rows, *shape[2:])) for e in range(shape[0])
                      for key in expert_keys(match["base"], match["name"], e)]
        else:
            pieces = [(name, shape)]
        out.append(Entry(name, tensor, to, pieces, tensor.numel() * to.itemsize))
    return out


def _files(entries: list[Entry], max_bytes: int) -> list[OutFile]:
    """Entries in order, a new file when the next one would pass `max_bytes` (a bigger tensor gets a file alone)."""
    files: list[OutFile] = []
    for entry in entries:
        if not files or (files[-1].entries and files[-1].nbytes + entry.nbytes > max_bytes):
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


def _stream(files: list[OutFile], out: Path, group, block_bytes: int) -> None:
    """Every rank sends its shard of every entry, block by block, to group rank 0, which writes the files."""
    rank = 0 if group is None else dist.get_rank(group)
    for f in files:
        with open(out / f.name, "wb") if rank == 0 else contextlib.nullcontext() as handle:
            if rank == 0:
                handle.write(_header(f))
            for entry in f.entries:
                _stream_entry(entry, handle, rank, group, block_bytes)


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


def save_pretrained(model: nn.Module, path, *, dtype: torch.dtype | None = None, max_shard_size: int | str = "50GB",
                    block_bytes: int = BLOCK_BYTES) -> Path:
    """Write `model` (any supported class; FSDP2-sharded, replicated or on one process) as a transformers
    checkpoint directory `path` (see the module docstring); every rank holding a shard calls this, rank 0 of the
    model's mesh writes. dtype: the stored floating dtype (None: each parameter's own, e.g. float32 master
    weights). Files of an earlier save in `path` (model*.safetensors, the index) are replaced, as
    `model.save_pretrained` does. Returns `path`."""
    from transformers.utils.hub import convert_file_size_to_int

    out = Path(path)
    entries = _entries(model, dtype)
    group = _group_of(entries)
    rank = 0 if group is None else dist.get_rank(group)
    files = _files(entries, convert_file_size_to_int(max_shard_size))
    with LocalChecks() as checks:
        unsupported = sorted({str(e.dtype) for e in entries if e.dtype not in SAFETENSORS_DTYPES})
        if unsupported:
            raise ValueError(f"save_pretrained: no safetensors dtype for {unsupported}")
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            for old in out.iterdir():
                if _WEIGHT_FILES.fullmatch(old.name) or old.name == INDEX_NAME:
                    old.unlink()
    if group is not None:
        raise_together(group, "save_pretrained", checks.error)
    elif checks.error is not None:
        raise checks.error
    _stream(files, out, group, block_bytes)
    if rank == 0:
        if len(files) > 1:
            weight_map = {key: f.name for f in files for e in f.entries for key, _ in e.pieces}
            index = {"metadata": {"total_parameters": sum(e.tensor.numel() for e in entries),
                                  "total_size": sum(f.nbytes for f in files)}, "weight_map": weight_map}
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_configs(model, out, entries, dtype)
    if group is not None:
        dist.barrier(group)  # no rank returns before the directory is complete
    return out


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
