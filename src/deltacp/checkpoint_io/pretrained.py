"""`load_pretrained`: a transformers checkpoint into a CP (+ FSDP2) model, every rank reading only its shard.

    mesh = init_cp_mesh(cp=4, dp=2)                                  # 8 ranks (torchrun)
    model = load_pretrained("Qwen3.5-27B", mesh, linear_attention_cp_mode="p2p", activation_checkpointing=True)

Steps: read config.json and the safetensors headers of the checkpoint's files (the index's, else model.safetensors;
no weights but a few KiB sampled for the digest); build the model on the meta device in the checkpoint's dtype (or
`dtype=`); check that every parameter has its stored tensor (`checkpoint_io/hf_format.py`: text prefixes, per-expert or
fused experts, tied embeddings), and that every rank read the same checkpoint, on every rank together; apply CP,
activation checkpointing and FSDP2 (`parallelize_and_shard`, the trainer's order) while the model is still on the
meta device; allocate each rank's shard (`to_empty`); fill it through torch.distributed.checkpoint's
`HuggingFaceStorageReader`, which plans, for each stored tensor, the rows this rank holds, read with plain file
reads in 64 MiB blocks and converted to the parameter's dtype as they are copied in (`row_reader`); recompute the
non-persistent buffers (rotary inverse frequencies) as transformers does. No rank ever holds more than its shard of
the parameters plus one block.

Under FSDP2 (the default) each rank holds 1 / (dp x cp) of the model; with `fsdp=False` every rank holds all
of it (read straight into the final dtype and device, no second copy).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.mesh import batch_group_of, cp_group_of
from deltacp.models.adapters import adapter_for, refuse_class, supported_classes
from deltacp.models.checkpointing import CheckpointingPlan, checkpointing_plan
from deltacp.models.compose import parallelize_and_shard
from deltacp.parallel.plan import CPPlan
from deltacp.checkpoint_io.hf_format import (
    FLOAT_DTYPES,
    FUSED_EXPERTS,
    StoredTensor,
    dominant_dtype,
    expert_keys,
    float_dtype,
    fused_rows,
    input_embedding_name,
    model_tensors,
    read_header,
    renamed,
    row_pieces,
    row_split,
    scan_checkpoint,
    stored_key,
    stored_name,
    stored_text_prefix,
    text_prefixes,
    text_prefix_of,
)

logger = logging.getLogger(__name__)

DTYPES = FLOAT_DTYPES  # (the name this module exported)


@dataclass(frozen=True)
class Source:
    """Where one model tensor is stored: `key`, a tensor of the same shape; or, for fused experts stored per
    expert, `experts[e]` = the (key, rows) pieces whose rows, in order, make row e; or, for a tensor the family
    stores in row pieces, `rows` = the (key, rows) pieces whose rows, in order, make the tensor's; or, for a tensor
    stored fused with its neighbours, `fused` = (key, the row of that stored tensor where its rows start)."""

    key: str | None = None
    experts: tuple[tuple[tuple[str, int], ...], ...] | None = None
    rows: tuple[tuple[str, int], ...] | None = None
    fused: tuple[str, int] | None = None


def resolve_checkpoint_dir(path) -> Path:
    """A local checkpoint directory: `path` itself, or the cached snapshot of a Hugging Face repo id already
    downloaded (nothing is downloaded here: every rank would)."""
    local = Path(path)
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception:  # noqa: BLE001  (not a repo id, or not in the cache: the one message below)
        raise FileNotFoundError(f"{path}: not a local checkpoint directory nor a downloaded Hugging Face repo; "
                                f"download it first (e.g. `hf download {path} --local-dir DIR`)") from None


def resolve_class(path: Path, model_class, config=None) -> type:
    """The transformers class to build: `model_class` (a class or its name), else the architectures[0] of `config`
    or of config.json; one `supported_classes()` lists, else NotImplementedError naming them."""
    import transformers

    if model_class is None:
        if config is not None and getattr(config, "architectures", None):
            architectures = config.architectures
        elif not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json")
        else:
            architectures = _raw_config(path).get("architectures") or []
        if not architectures:
            raise ValueError(f"{path}: the config names no architectures: pass model_class= one of "
                             f"{supported_classes()}")
        model_class = architectures[0]
    name = model_class if isinstance(model_class, str) else getattr(model_class, "__name__", repr(model_class))
    refuse_class(name, "load_pretrained")
    if name not in supported_classes():
        raise NotImplementedError(f"load_pretrained: model class {name} is not supported; expected one of "
                                  f"{supported_classes()} (pass model_class=...)")
    return getattr(transformers, name)


def _raw_config(path: Path) -> dict:
    """config.json of `path` as read ({} without one); ValueError naming the file where it is not a JSON object."""
    file = path / "config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"{file}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: not a JSON object")
    return raw


def resolve_dtype(dtype, config, path: Path, stored: dict[str, StoredTensor]) -> torch.dtype:
    """`dtype` (a torch dtype or its name); None / 'auto': the checkpoint's, as `from_pretrained` takes it (the
    config's dtype, else config.json's, else the floating dtype holding most of the stored bytes)."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            raw = _raw_config(path)
            dtype = raw.get("dtype") or raw.get("torch_dtype")
        if dtype is None:
            dtype = dominant_dtype((t.dtype, t.nbytes) for t in stored.values()
                                   if isinstance(t.dtype, torch.dtype) and t.dtype.is_floating_point) or torch.float32
    return float_dtype(dtype, "dtype", also=", None or 'auto' (the checkpoint's)")


def build_on_meta(cls: type, config, dtype: torch.dtype) -> nn.Module:
    """The model of `cls` for `config` on the meta device, parameters in `dtype` (buffers as transformers makes
    them: the rotary frequencies stay float32), as `from_pretrained` builds it before reading weights."""
    with torch.device("meta"):
        return cls._from_config(copy.deepcopy(config), dtype=dtype)


def plan_sources(model: nn.Module, stored: dict[str, StoredTensor], path) -> tuple[dict[str, Source], list[str]]:
    """The stored source of every model tensor (`model_tensors`), and the stored keys left unread that transformers
    would call unexpected. ValueError naming the tensors the checkpoint lacks, or a shape that differs."""
    family = adapter_for(model).family
    renames = family.checkpoint_renames
    embedding = input_embedding_name(model)
    aliases = family.checkpoint_load_aliases
    checkpoint_prefix = stored_text_prefix(stored, embedding, renames, family.text_attribute, aliases)
    if checkpoint_prefix is None:
        names = [renamed(f"{p}{embedding}.weight", renames) for p in text_prefixes(family.text_attribute)]
        raise ValueError(f"{path}: no input embedding ({', '.join(names)}): not a checkpoint of "
                         f"{type(model).__name__}")
    model_prefix = text_prefix_of(model)
    sources, missing, problems, used = {}, [], [], set()
    for name, tensor in model_tensors(model):
        key = stored_name(name, model_prefix, checkpoint_prefix, renames)
        if key not in stored and renames:  # stored without the renamed part: loads as it is (module docstring)
            plain = stored_name(name, model_prefix, checkpoint_prefix)
            key = plain if plain in stored else key
        key = stored_key(key, stored, aliases) or key  # or its older name (`Family.checkpoint_load_aliases`)
        shape = tuple(tensor.shape)
        pieces = row_pieces(model, name)
        if key not in stored and pieces is not None:
            # the rows as stored: the module's split (the released checkpoints), or any other one whose rows make
            # the tensor's in order (transformers 5.25's save_pretrained writes OLMo-Hybrid's conv in equal thirds)
            names = [stored_name(n, model_prefix, checkpoint_prefix, renames) for n, _ in pieces]
            absent = [k for k in names if k not in stored]
            if absent:
                missing.append(f"{name} (stored as {key}, or in row pieces {names})")
                continue
            keys = [(k, stored[k].shape[0] if stored[k].shape else 0) for k in names]
            if (sum(rows for _, rows in keys) != shape[0]
                    or any(stored[k].shape[1:] != shape[1:] for k, _ in keys)):
                problems.append(f"{[k for k, _ in keys]} are stored with shapes {[stored[k].shape for k, _ in keys]}, "
                                f"which do not make the rows of {name} {shape}")
                continue
            sources[name] = Source(rows=tuple(keys))
            used.update(k for k, _ in keys)
            continue
        fused = fused_rows(model, name)
        if key not in stored and fused is not None:  # rows of one stored tensor with its neighbours' (LaRA's in_proj)
            whole, first, total, _ = fused
            whole = stored_name(whole, model_prefix, checkpoint_prefix, renames)
            if whole not in stored:
                missing.append(f"{name} (stored as {key}, or as rows of {whole})")
            elif stored[whole].shape != (total, *shape[1:]):
                problems.append(f"{whole} is stored with shape {stored[whole].shape}, its parts make {(total, *shape[1:])}")
            else:
                sources[name] = Source(fused=(whole, first))
                used.add(whole)
            continue
        if key in stored:
            if stored[key].shape != shape:
                problems.append(f"{key} is stored with shape {stored[key].shape}, {name} has {shape}")
            if not isinstance(stored[key].dtype, torch.dtype) or stored[key].dtype.is_floating_point != (
                    tensor.is_floating_point()):
                problems.append(f"{key} is stored as {stored[key].dtype}, {name} is {tensor.dtype}")
            sources[name] = Source(key=key)
            used.add(key)
            continue
        match = FUSED_EXPERTS.fullmatch(key)
        if match is None or len(shape) < 2:
            missing.append(f"{name} (stored as {key})")
            continue
        experts = []
        for e in range(shape[0]):
            keys = expert_keys(match["base"], match["name"], e, family.checkpoint_expert_names)
            absent = [k for k in keys if k not in stored]
            if absent:
                missing.append(f"{name} (stored fused as {key}, or per expert as {absent[0]}, ...)")
                break
            pieces = tuple((k, stored[k].shape[0]) for k in keys)
            if (sum(rows for _, rows in pieces) != shape[1]
                    or any(stored[k].shape[1:] != shape[2:] for k in keys)):
                problems.append(f"{keys} are stored with shapes {[stored[k].shape for k in keys]}, which do not make "
                                f"row {e} of {name} {shape}")
                break
            experts.append(pieces)
            used.update(keys)
        else:
            sources[name] = Source(experts=tuple(experts))
    cls = type(model).__name__
    if missing:
        hint = ""
        text_class = adapter_for(model).family.causal_lm
        if any(".visual." in m for m in missing):
            hint = (f"; the checkpoint has no vision tower: load its text model with model_class={text_class}"
                    if text_class is not None else
                    f"; the checkpoint has no vision tower, and {adapter_for(model).family.name} has no causal-LM "
                    f"class to load instead: its vision tensors must be in the checkpoint")
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) of {cls}, e.g. "
                         f"{'; '.join(missing[:3])}{hint}")
    if problems:
        raise ValueError(f"{path}: the checkpoint does not fit {cls} (config.json and the weights disagree?): "
                         f"{'; '.join(problems[:3])}")
    ignored = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []) + [r"rotary_emb\.inv_freq"]
    if tied_head(model):  # a stored output embedding is not read: the input embedding is the model's only copy
        ignored.append(r"(^|\.)lm_head\.weight$")
    unused = sorted(k for k in set(stored) - used if not any(re.search(p, k) for p in ignored))
    return sources, unused


def row_reader(path: Path, stored: dict[str, StoredTensor], block_bytes: int):
    """torch.distributed.checkpoint's `HuggingFaceStorageReader` (its planning and resharding) over the tensors of
    `stored` (the files the index names: `scan_checkpoint`), reading the slices it plans, each a run of whole rows of a
    stored tensor (a dim-0 shard, a whole tensor: all that FSDP2 and the per-expert rows ask for), with plain file
    reads, `block_bytes` at a time, converted into the destination as they arrive. Why not its safetensors reads:
    they go through a memory map, whose pages of a file stay resident (and count in the rank's RSS) until the file
    is closed, which adds the rank's share of the whole file to its peak (measured on 4 ranks loading a ~96 MiB
    one-file bf16 checkpoint as float32: 0.86-1.05x of its bytes per rank, against 0.58x here, the rank's share
    being 0.50x); here the peak is one block."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)
    from torch.futures import Future

    class RowReader(HuggingFaceStorageReader):
        def read_metadata(self) -> Metadata:
            """The tensors of `stored` only (HuggingFaceStorageReader's own lists every *.safetensors in the
            directory, a stale file beside the index's shards included)."""
            tensors, storage = {}, {}
            for key, info in stored.items():
                if not isinstance(info.dtype, torch.dtype):
                    continue  # a dtype torch lacks (plan_sources refuses it where a parameter needs it)
                zero = torch.Size([0] * len(info.shape))
                tensors[key] = TensorStorageMetadata(TensorProperties(dtype=info.dtype), torch.Size(info.shape),
                                                     [ChunkStorageMetadata(zero, torch.Size(info.shape))])
                storage[MetadataIndex(fqn=key, offset=zero)] = info
            metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)
            metadata.storage_meta = StorageMeta(load_id=self.load_id)
            return metadata

        def read_data(self, plan, planner):
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
            for file, items in per_file.items():
                header, start, _ = read_header(Path(file))
                with open(file, "rb", buffering=0) as f:
                    for item in items:
                        begin = start + header[item.storage_index.fqn]["data_offsets"][0]
                        _read_rows(f, begin, self.storage_data[item.storage_index], item, planner, block_bytes)
            done: Future = Future()
            done.set_result(None)
            return done

    return RowReader(str(path))


def _read_rows(f, begin: int, info, item, planner, block_bytes: int) -> None:
    """Read `item`, whole rows of the stored tensor whose data starts at byte `begin` of file `f`, into its
    destination (NotImplementedError for any other slice: `row_split` admits no placement that plans one)."""
    shape, offsets, lengths = tuple(info.shape), tuple(item.storage_offsets), tuple(item.lengths)
    target = planner.resolve_tensor(item).detach()
    if any(o != 0 or n != d for o, n, d in zip(offsets[1:], lengths[1:], shape[1:], strict=True)) or (
            not target.is_contiguous()):
        raise NotImplementedError(f"{item.storage_index.fqn}: a slice {offsets} + {lengths} of {shape} that is not "
                                  f"whole contiguous rows")
    rest = shape[1:]
    row_bytes = info.dtype.itemsize * math.prod(rest)
    rows = lengths[0] if shape else 1
    dest = target.view(rows, *rest)
    step = max(1, block_bytes // max(1, row_bytes))
    buffer = torch.empty(min(rows, step) * row_bytes, dtype=torch.uint8)
    f.seek(begin + (offsets[0] if shape else 0) * row_bytes)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        chunk = buffer[:(b - a) * row_bytes]
        view, got = memoryview(chunk.numpy()), 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{f.name}: the file ends inside tensor {item.storage_index.fqn} (truncated?)")
            got += n
        dest[a:b].copy_(chunk.view(info.dtype).view(b - a, *rest))
    planner.commit_tensor(item, target)


def read_weights(model: nn.Module, sources: dict[str, Source], path: Path, stored: dict[str, StoredTensor], group,
                 block_bytes: int = 64 * 2**20) -> int:
    """Fill every rank's share of the model tensors from the checkpoint (collective over `group`); returns the
    bytes this rank holds. torch.distributed.checkpoint plans the reads: per tensor, the rows of each stored tensor
    that overlap this rank's shard, converted to the destination's dtype as they are copied in (`row_reader`)."""
    from torch.distributed.checkpoint import load

    state, held, assemble = {}, 0, []
    for name, tensor in model_tensors(model):
        source = sources[name]
        local, first, _ = row_split(tensor)
        held += local.numel() * local.element_size()
        if source.rows is not None:  # small tensors (a conv weight): every piece read whole, this rank's rows kept
            pieces = [torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=local.device)
                      for _, rows in source.rows]
            state.update({key: piece for (key, _), piece in zip(source.rows, pieces)})
            assemble.append((local, first, pieces))
            continue
        if source.fused is not None:  # small tensors (a projection): the stored tensor read whole once, this rank's rows
            # of its part kept
            key, start = source.fused
            if key not in state:
                state[key] = torch.empty(stored[key].shape, dtype=tensor.dtype, device=local.device)
            assemble.append((local, start + first, [state[key]]))
            continue
        if source.experts is None:
            state[source.key] = tensor  # a DTensor: DCP reads the rows of this rank's shard
            continue
        for row, pieces in zip(local.detach(), source.experts[first:first + local.shape[0]], strict=True):
            start = 0
            for key, rows in pieces:  # expert e's gate_proj then up_proj rows make its row of gate_up_proj
                state[key] = row[start:start + rows]
                start += rows
    with torch.no_grad():
        load(state, storage_reader=row_reader(path, stored, block_bytes), process_group=group)
        for local, first, pieces in assemble:
            local.copy_(torch.cat(pieces)[first:first + local.shape[0]].reshape(local.shape))
    return held


def init_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers after `to_empty` (they are in no checkpoint): the family's hook first
    (`Family.recompute_buffers`: Falcon-H1's mup_vector), then transformers' own initialisation of the module that
    owns each remaining one (the rotary modules' inverse frequencies, as `from_pretrained` does); NotImplementedError
    naming a buffer that nothing recomputes, or one in a module with parameters of its own (recomputing it would
    re-initialise loaded weights)."""
    from transformers import PreTrainedModel

    adapter = adapter_for(model)
    hook = adapter.family.recompute_buffers  # the family's own (Falcon-H1's mup_vector)
    done = set(hook(model, adapter.text_config)) if hook is not None else set()
    owners = {name: m for name, m in model.named_modules() if isinstance(m, PreTrainedModel)}
    for name, module in model.named_modules():
        own = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not own or name in done:
            continue
        if any(True for _ in module.parameters(recurse=False)) or any(
                not getattr(module, b).is_floating_point() for b in own):
            raise NotImplementedError(f"{name} ({type(module).__name__}) has non-persistent buffers {own} that "
                                      f"load_pretrained cannot recompute")
        for b in own:
            getattr(module, b).fill_(math.nan)
        owner = max((n for n in owners if n == "" or name.startswith(n + ".")), key=len)
        with torch.no_grad():
            owners[owner]._init_weights(module)
        stale = [b for b in own if torch.isnan(getattr(module, b)).any()]
        if stale:
            raise NotImplementedError(f"{name} ({type(module).__name__}): transformers' initialisation leaves the "
                                      f"non-persistent buffers {stale} unset; load_pretrained cannot recompute them")


def tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter that several modules hold (tied embeddings, Zamba2's shared blocks): the (module, attribute)
    pairs of each, the first the one `named_parameters` keeps (the stored name)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    return [pairs for pairs in holders.values() if len(pairs) > 1]


def retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each group of `tied_parameters` one parameter again (the first holder's)."""
    for (first, first_name), *rest in ties:
        param = getattr(first, first_name)
        for module, name in rest:
            if getattr(module, name) is not param:
                setattr(module, name, param)


def tied_head(model: nn.Module) -> bool:
    """Whether the model's output embedding is its input embedding's parameter (tie_word_embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and head.weight is model.get_input_embeddings().weight


def load_device(device, cp_mesh: DeviceMesh) -> torch.device:
    """Where load_pretrained puts the parameters: `device`, or (None) this rank's GPU on a CUDA mesh, else the CPU.
    The meta device is refused: it holds no weights to read into (build a model without weights with
    `build_on_meta`, then `parallelize_cp`)."""
    if device is None:
        return (torch.device("cuda", torch.cuda.current_device()) if cp_mesh.device_type == "cuda"
                else torch.device(cp_mesh.device_type))
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type == "meta":
        why = "holds no weights to read into" if parsed is not None else "is not a device"
        raise ValueError(f"load_pretrained: device={device!r} {why}; expected None (this rank's GPU on a CUDA mesh, "
                         f"else the CPU), 'cpu' or a CUDA device (for a model without weights, build it on the meta "
                         f"device and apply parallelize_cp)")
    return parsed


def load_pretrained(path, cp_mesh: DeviceMesh, *, plan: CPPlan | None = None, dtype=None, fsdp: bool = True,
                    model_class=None, config=None,
                    activation_checkpointing: bool | int | str | CheckpointingPlan = False, mp_policy=None, device=None,
                    **settings) -> nn.Module:
    """The model of the transformers checkpoint directory `path` under CP on `cp_mesh` (every rank calls this);
    each rank reads only the part of each stored tensor that it holds.

    dtype: the parameters' dtype; None: the checkpoint's (config.json), as `from_pretrained`. fsdp: FSDP2 over
    every rank of the mesh (dp x cp for a ("dp", "cp") mesh), summed gradients; False: replicated parameters (sum
    their gradients with `all_reduce_cp_grads`). model_class: a supported class or its name; None: config.json's
    architectures (a released Qwen3.5 checkpoint is the multimodal class; pass `Qwen3_5ForCausalLM` for its text
    model alone). config: a transformers config to build instead of config.json's. activation_checkpointing:
    False, True (every decoder layer), n (every n-th), "full" / "selective" or a CheckpointingPlan
    (`models/checkpointing.py`), applied between CP and FSDP2. mp_policy: FSDP2 mixed
    precision (a `MixedPrecisionPolicy` or its keywords). device: where the parameters live; None: this rank's
    GPU on a CUDA mesh, else the CPU. plan: the CP settings (a `CPPlan`), or its fields as the other keywords
    (linear_attention_cp_mode, ..., as `parallelize_cp`).

    Reads the files `model.safetensors.index.json` names (each tensor from the file its weight_map gives; another
    `*.safetensors` beside them is ignored), else `model.safetensors`; refuses shards without an index and an index
    beside a `model.safetensors` it does not name (transformers would read that file: which one is stale is
    unknown), as `hf_format.checkpoint_files` says.

    Returns the model in eval mode (as `from_pretrained`), on `device`, CP applied (and FSDP2: its parameters are
    DTensors). Errors (a file missing or unreadable on any rank, a tensor the checkpoint lacks, a bad setting,
    device='meta') are raised on every rank together, before any weight is read; so are ranks given different
    checkpoints (a digest of their config.json, index, file sizes, safetensors headers and 16 KiB of each file's data
    sampled at four places).
    """
    group = batch_group_of(cp_mesh)
    start = time.perf_counter()
    model = sources = unused = checkpointing = stored = None
    agree = {}
    with LocalChecks(OSError) as checks:  # (a file missing or unreadable on one rank: every rank raises)
        plan = CPPlan.resolve(plan, settings, cp_group_of(cp_mesh).size(), "load_pretrained")
        checkpointing = checkpointing_plan(activation_checkpointing)
        device = load_device(device, cp_mesh)
        path = resolve_checkpoint_dir(path)
        checkpoint = scan_checkpoint(path)
        stored = checkpoint.stored
        cls = resolve_class(path, model_class, config)
        if config is None:
            config = cls.config_class.from_pretrained(str(path), local_files_only=True)
        quantized = getattr(config, "quantization_config", None) or _raw_config(path).get("quantization_config")
        if quantized:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
            raise NotImplementedError(f"{path}: a quantized checkpoint (quantization_config: {method}); "
                                      f"load_pretrained reads unquantized weights (the bf16 release)")
        dtype = resolve_dtype(dtype, config, path, stored)
        model = build_on_meta(cls, config, dtype)
        sources, unused = plan_sources(model, stored, path)
        agree = dict(model_class=cls.__name__, dtype=str(dtype), fsdp=fsdp, tensors=len(sources),
                     checkpoint=checkpoint.digest)
    raise_together(group, "load_pretrained", checks.error, agree=agree)
    if unused and group.rank() == 0:
        logger.warning("load_pretrained: %d stored tensor(s) of %s are not part of %s and were not read, e.g. %s",
                       len(unused), path, cls.__name__, unused[:3])
    parallelize_and_shard(model, cp_mesh, plan, fsdp=fsdp, activation_checkpointing=checkpointing or False,
                          mp_policy=mp_policy)
    ties = tied_parameters(model)
    model.to_empty(device=device)
    retie(ties)  # to_empty gives each module its own parameter (FSDP2 keeps them shared)
    held = read_weights(model, sources, path, stored, group)
    init_buffers(model)
    logger.info("Loaded %s from %s (%s, %d tensors, %.2f GiB on this rank) in %.1f s", cls.__name__, path, dtype,
                len(sources), held / 2**30, time.perf_counter() - start)
    return model.eval()
