"""The transformers checkpoint format, as `load_pretrained` reads it and `save_pretrained` writes it.

A checkpoint directory holds config.json and safetensors files: `model.safetensors`, or
`model-0000i-of-0000N.safetensors` with `model.safetensors.index.json` (its weight_map names the file of every
tensor). Stored names differ from the module names of the class being loaded in two ways (transformers 5.25's
conversion mapping, `transformers/conversion_mapping.py`, does the same renaming on load):

- the text model's prefix: a multimodal checkpoint (every released Qwen3.5 size is
  `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`) stores the language model under
  `model.language_model.`, a causal-LM one under `model.`, a bare text model under no prefix; any text class
  loads from any of them (the vision tower, `model.visual.*`, and the multi-token-prediction head, `mtp.*`, are
  then left unread, as transformers ignores them);
- the family's names (`Family.checkpoint_renames`, `checkpoint_row_pieces`, `checkpoint_fused_rows`, from its
  home): dotted name parts renamed (OLMo-Hybrid's decoder norms), tensors stored as row pieces (OLMo-Hybrid's conv
  weight as one weight per q, k, v, whose rows make the module's in order), and consecutive parameters stored as one
  tensor of their rows in order (LaRA-mini's `linear_attn.in_proj` = [in_proj_qkv | in_proj_z | in_proj_b |
  in_proj_a]);
- routed experts: the modules hold fused `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`
  [E, H, I]; a checkpoint stores them fused under those names (the released Qwen3.5 MoE sizes) or per expert,
  `mlp.experts.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H], `.down_proj.weight` [H, I] (Qwen3-Next's
  release, and what transformers 5.25's `save_pretrained` writes for every MoE family: the "qwen2_moe" mapping,
  expert e's row of gate_up_proj = gate_proj then up_proj), each family naming the three per-expert matrices its
  own way (`Family.checkpoint_expert_names`: Kimi-Linear's w1, w3, w2);
- a stored name without the family's renames is read too (transformers' renames are patterns over the stored
  names: a name that lacks the renamed part loads as it is), so a checkpoint with Kimi-Linear's dense MLPs under
  `mlp.` and its routed ones under `block_sparse_moe.` loads, as one with both under `block_sparse_moe.`.

Tied embeddings (`tie_word_embeddings`): the output embedding is the input embedding's parameter and is neither
read nor written (transformers does not store it either). Non-persistent buffers (the rotary inverse
frequencies) are never stored.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deltacp.models.adapters import adapter_for

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TEXT_PREFIXES = ("model.language_model.", "model.", "")  # where checkpoints keep the text model, longest first
# the roles (0 gate, 1 up, 2 down) of each fused expert tensor's rows, in order
EXPERT_PARTS = {"gate_up_proj": (0, 1), "up_proj": (1,), "down_proj": (2,)}
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # the per-expert names of the three roles (most families)
FUSED_EXPERTS = re.compile(r"(?P<base>.+\.experts)\.(?P<name>gate_up_proj|up_proj|down_proj)")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
SAFETENSORS_DTYPES = {dtype: name for name, dtype in _DTYPES.items()}
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64}  # what load_pretrained builds in and save_pretrained stores


def float_dtype(value, setting: str, also: str = "") -> torch.dtype:
    """A floating dtype of FLOAT_DTYPES, given as a torch dtype or its name; ValueError naming `setting` and the
    allowed values (`also`: the other values the caller takes) otherwise: an integer dtype would store cast weights
    that transformers refuses."""
    dtype = FLOAT_DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in FLOAT_DTYPES.values():
        raise ValueError(f"{setting}={value!r} is not supported; expected one of {list(FLOAT_DTYPES)} (a torch dtype "
                         f"or its name){also}")
    return dtype


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint: its file, shape and dtype (from the safetensors headers alone)."""

    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | str  # the safetensors name where torch has no such dtype (e.g. F8_E4M3)

    @property
    def nbytes(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        itemsize = self.dtype.itemsize if isinstance(self.dtype, torch.dtype) else 1
        return n * itemsize


def checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of the checkpoint directory `path` to read, and the index's weight_map (None without an
    index): with `model.safetensors.index.json`, exactly the files its weight_map names (another `*.safetensors`
    beside them, shards of an older save say, is not read); else `model.safetensors`. Refused, naming the files:
    shards without an index (transformers refuses them too), and an index beside a `model.safetensors` it does not
    name: transformers 5.25 then reads `model.safetensors` and ignores the index, while the index is most likely the
    newer save, so either choice could load stale weights without a word. FileNotFoundError / ValueError."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of tensor names to file names")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
        names = sorted(set(weight_map.values()))
        absent = [name for name in names if not (path / name).is_file()]
        if absent:
            raise FileNotFoundError(f"{path}: {INDEX_NAME} names {len(absent)} file(s) that are not there, e.g. "
                                    f"{absent[0]} (an incomplete download?)")
        if (path / SINGLE_NAME).is_file() and SINGLE_NAME not in names:
            raise ValueError(f"{path}: both {SINGLE_NAME} and {INDEX_NAME} (naming {len(names)} other file(s), e.g. "
                             f"{names[0] if names else 'none'}): which is the checkpoint is ambiguous (transformers "
                             f"reads {SINGLE_NAME}, ignoring the index); remove the stale one")
        return [path / name for name in names], weight_map
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME], None
    others = sorted(p.name for p in path.glob("*.safetensors"))
    if others:
        raise FileNotFoundError(f"{path}: {len(others)} safetensors file(s) ({', '.join(others[:3])}) but neither "
                                f"{SINGLE_NAME} nor {INDEX_NAME}: transformers reads only those (an index names the "
                                f"shards)")
    raise FileNotFoundError(f"{path}: no *.safetensors files (a transformers checkpoint directory holds "
                            f"{SINGLE_NAME}, or model-0000i-of-0000N.safetensors with {INDEX_NAME})")


def read_header(file: Path) -> tuple[dict, int, bytes]:
    """The safetensors header of `file` (tensor name -> dtype, shape, data_offsets), the byte where its data
    begins, and the header's raw bytes. ValueError naming the file for anything that is not a whole safetensors
    file (too short, a header that is not JSON, tensors that end past the file: truncated)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        start = f.read(8)
        (length,) = struct.unpack("<Q", start) if len(start) == 8 else (None,)
        if length is None or length > size - 8:
            raise ValueError(f"{file}: not a safetensors file ({size} bytes, no complete header; truncated?)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
        header.pop("__metadata__", None)
        end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"{file}: not a safetensors file (its header does not parse: {type(exc).__name__}: "
                         f"{exc})") from None
    if 8 + length + end > size:
        raise ValueError(f"{file}: truncated: its tensors end at byte {8 + length + end}, the file has {size}")
    return header, 8 + length, raw


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint directory holds, from its index and safetensors headers alone (no weights read)."""

    stored: dict[str, StoredTensor]
    digest: str  # sha256 of config.json, the index, each read file's name, size, header and sampled data


def scan_checkpoint(path: str | Path) -> Checkpoint:
    """Every tensor of the checkpoint directory `path` that transformers would read (`checkpoint_files`: with an
    index, each name from the file its weight_map gives), and the checkpoint's digest. Errors name the directory
    or file: no safetensors, an index naming a missing file or a tensor its file lacks, a file that is not whole."""
    path = Path(path)
    files, weight_map = checkpoint_files(path)
    digest = hashlib.sha256()
    for extra in (path / "config.json", path / INDEX_NAME):
        digest.update(extra.name.encode() + b"\0" + (extra.read_bytes() if extra.is_file() else b"-") + b"\0")
    stored = {}
    for file in files:
        header, start, raw = read_header(file)
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode() + raw + _sampled_data(file, start))
        for key, info in header.items():
            if weight_map is None or weight_map.get(key) == file.name:
                dtype = info.get("dtype")
                stored[key] = StoredTensor(str(file), tuple(info["shape"]), _DTYPES.get(dtype, dtype))
    if weight_map is not None:
        lacking = sorted(set(weight_map) - set(stored))
        if lacking:
            raise ValueError(f"{path}: {INDEX_NAME} puts {len(lacking)} tensor(s) in files that do not hold them, "
                             f"e.g. {lacking[0]} in {weight_map[lacking[0]]}")
    return Checkpoint(stored, digest.hexdigest())


def _sampled_data(file: Path, start: int, windows: int = 4, size: int = 4096) -> bytes:
    """`windows` runs of `size` bytes of the file's data, spread from its first byte to its last: two checkpoints of
    the same shapes (same headers and sizes) almost surely differ there, and the read costs nothing next to the
    weights."""
    end = file.stat().st_size
    span = max(end - start - size, 0)
    out = []
    with open(file, "rb") as f:
        for i in range(windows):
            f.seek(start + span * i // max(windows - 1, 1))
            out.append(f.read(size))
    return b"".join(out)


def read_index(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint directory `path` (`scan_checkpoint`'s `stored`)."""
    return scan_checkpoint(path).stored


def text_prefix_of(model: nn.Module) -> str:
    """The module path of the text model inside `model` ('' for a bare text model), with a trailing dot."""
    text = adapter_for(model).text
    for name, module in model.named_modules():
        if module is text:
            return f"{name}." if name else ""
    raise ValueError(f"{type(model).__name__}: its text model is not one of its modules")  # not reached


def input_embedding_name(model: nn.Module) -> str:
    """The input embedding's module path inside the text model (`embed_tokens`; Nemotron-H: `embeddings`)."""
    text = adapter_for(model).text
    embedding = text.get_input_embeddings()
    return next(name for name, module in text.named_modules() if module is embedding)


def text_prefixes(text_attribute: str = "model") -> tuple[str, ...]:
    """TEXT_PREFIXES with a causal LM's own attribute for its text model (`Family.text_attribute`; Mamba2:
    `backbone.`) in place of `model.`."""
    return tuple(f"{text_attribute}." if p == "model." else p for p in TEXT_PREFIXES)


def stored_text_prefix(stored: dict[str, StoredTensor], embedding: str = "embed_tokens",
                       renames: tuple[tuple[str, str], ...] = (), text_attribute: str = "model",
                       aliases: tuple[tuple[str, str], ...] = ()) -> str | None:
    """Where the checkpoint keeps the text model (one of `text_prefixes(text_attribute)`), found by its input
    embedding (its name in the text model, the family's renames applied, or its older name: `aliases`)."""
    for prefix in text_prefixes(text_attribute):
        if stored_key(renamed(f"{prefix}{embedding}.weight", renames), stored, aliases) is not None:
            return prefix
    return None


def stored_key(key: str, stored: dict[str, StoredTensor], aliases: tuple[tuple[str, str], ...] = ()) -> str | None:
    """`key` if the checkpoint holds it, else its older name (the family's `checkpoint_load_aliases`) if the
    checkpoint holds that, else None."""
    if key in stored:
        return key
    older = renamed(key, aliases)
    return older if aliases and older in stored else None


def stored_name(name: str, model_prefix: str, checkpoint_prefix: str,
                renames: tuple[tuple[str, str], ...] = ()) -> str:
    """The checkpoint name of the model tensor `name` (text tensors move from the model's text prefix to the
    checkpoint's; the others, the vision tower and the LM head, keep their names), the family's renames applied."""
    if name.startswith(model_prefix):
        name = checkpoint_prefix + name[len(model_prefix):]
    return renamed(name, renames)


def renamed(name: str, renames: tuple[tuple[str, str], ...], to_stored: bool = True) -> str:
    """`name` with the family's renames applied (module -> stored, or back): each pair renames a run of whole
    dotted parts ("input_layernorm", or "block_sparse_moe.experts.down_proj"), wherever it occurs."""
    if not renames:
        return name
    dotted = f".{name}."
    for module_part, stored_part in renames:
        a, b = (module_part, stored_part) if to_stored else (stored_part, module_part)
        dotted = dotted.replace(f".{a}.", f".{b}.")
    return dotted[1:-1]


def row_pieces(model: nn.Module, name: str) -> list[tuple[str, int]] | None:
    """The (name, rows) pieces of model tensor `name` when its family stores it in row pieces (names before the text
    prefix and the renames are applied), else None. A piece's rows: the named attribute of the module that the
    suffix's first part names (OLMo-Hybrid: `linear_attn.key_dim`); or the family gives a function (that module,
    the text config) -> [(stored suffix, rows), ...] for pieces whose count is a config field (Qwen4-Exp's n-gram
    embedding shards)."""
    adapter = adapter_for(model)
    for suffix, pieces in adapter.family.checkpoint_row_pieces:
        if name == suffix or name.endswith("." + suffix):
            base = name[: len(name) - len(suffix)]
            owner = model.get_submodule(base + suffix.split(".")[0])
            if callable(pieces):
                return [(base + stored, int(rows)) for stored, rows in pieces(owner, adapter.text_config)]
            return [(base + stored, int(getattr(owner, rows))) for stored, rows in pieces]
    return None


def fused_rows(model: nn.Module, name: str) -> tuple[str, int, int, int] | None:
    """When the family stores model tensor `name` fused with the parameters beside it (`Family.checkpoint_fused_rows`:
    one stored tensor whose rows are theirs in order): (the stored tensor's name before the text prefix and the
    renames are applied, the row where `name`'s rows start in it, its rows, `name`'s place among the parts: 0 the
    first); else None."""
    for whole, parts in adapter_for(model).family.checkpoint_fused_rows:
        for place, part in enumerate(parts):
            if name == part or name.endswith("." + part):
                base = name[: len(name) - len(part)]
                rows = [model.get_parameter(base + p).shape[0] for p in parts]
                return base + whole, sum(rows[:place]), sum(rows), place
    return None


def expert_keys(base: str, name: str, expert: int, names: tuple[str, str, str] = EXPERT_NAMES) -> tuple[str, ...]:
    """The per-expert checkpoint names of expert `expert`'s row of the fused tensor `base.name`, in row order
    (`names`: the family's stored names of the gate, up and down matrices)."""
    return tuple(f"{base}.{expert}.{names[role]}.weight" for role in EXPERT_PARTS[name])


def model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint of `model` holds: its parameters (a tied one once, under its first name) and its persistent
    buffers, in module order."""
    out = list(model.named_parameters(remove_duplicate=True))
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{module_name}.{name}" if module_name else name, buffer))
    return out


def row_split(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(this rank's rows, the global index of its first row, the number of ranks sharing the rows) of a model
    tensor: a plain tensor is all rows of one holder; a DTensor must be sharded on dim 0 (FSDP2) or replicated over
    a 1-D mesh. NotImplementedError naming the placement otherwise."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor, 0, 1
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim != 1 or placements[0] not in (Shard(0), Replicate()):
        raise NotImplementedError(f"a DTensor with placements {placements} on a {mesh.ndim}-D mesh: pretrained "
                                  f"loading and saving take FSDP2's Shard(0) or Replicate() over a 1-D mesh")
    if placements[0] == Replicate():
        return tensor.to_local(), 0, 1
    size, offset = Shard.local_shard_size_and_offset(tensor.shape[0], mesh.size(), mesh.get_local_rank())
    return tensor.to_local(), offset, mesh.size()


def shard_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """(count, first row) of rank `rank`'s share of `rows` rows sharded over `ranks` ranks on dim 0 (FSDP2)."""
    from torch.distributed.tensor import Shard

    return Shard.local_shard_size_and_offset(rows, ranks, rank)


def dominant_dtype(sizes) -> torch.dtype | None:
    """The dtype holding the most bytes among (dtype, nbytes) pairs (None for none): what a checkpoint's config
    states as its dtype when nothing else does."""
    by_dtype: dict = {}
    for dtype, nbytes in sizes:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return max(by_dtype, key=by_dtype.get) if by_dtype else None


def transformers_class(model: nn.Module) -> type:
    """The transformers class of a model, under FSDP2's wrapper class (`FSDPQwen3_5ForCausalLM`)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
