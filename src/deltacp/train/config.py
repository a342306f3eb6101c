"""The trainer YAML, as typed dataclasses; unknown keys and bad values are errors that name the key.

    train:
      seed: 0
      steps: 100
      dtype: float32                 # float32 | float64 | bfloat16 (fp32 master weights, bf16 compute, fp32 reduce)
      activation_checkpointing: none # none | full | selective | auto (per decoder layer; auto: for
                                     # activation_checkpointing_budget_gib or _fraction of the device)
      loss: linear_cross_entropy     # | cross_entropy (full logits): the same value and gradients
      accelerator: {cp: 4, linear_attention_cp_mode: p2p}   # deltacp.config.AcceleratorConfig, exactly; dp: null
                                                             # derives dp = world // cp (8 ranks, cp 4: dp 2)
      model: {config: {hidden_size: 64, ...}, gate_init: long_memory}   # or {pretrained: /local/dir}
                                     # model_class: Qwen3_5ForCausalLM (default) | Qwen3_5MoeForCausalLM |
                                     # Qwen3NextForCausalLM | Qwen3_5ForConditionalGeneration | ...Moe...
      data: {source: stdlib, seq_len: 512}
      optimizer: {lr: 3.0e-3, weight_decay: 0.1, grad_clip: 1.0}
      schedule: {kind: cosine, warmup_steps: 10}
      checkpoint: {dir: runs/x/ckpt, interval: 50, resume: true, keep: 2}   # overwrite: false
      logging: {interval: 1}
      distributed: {backend: auto, timeout_s: 300}

`load_config(path, overrides)` reads the file, applies `--set train.a.b=value` overrides (values are YAML)
and validates everything that needs no process group (numbers must be finite; removed keys such as
train.model.attn_implementation say why); `TrainConfig.validate_world(world_size)` runs on every rank before
the first collective.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from deltacp.config import AcceleratorConfig
from deltacp.families.registry import FAMILIES, REFUSED, family_of, trainable_classes

DTYPES = ("float32", "float64", "bfloat16")


class ConfigError(ValueError):
    """A bad trainer configuration; the message names the key (e.g. train.optimizer.lr2)."""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (its type's name if it has none)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


MODEL_CLASSES = trainable_classes()  # the families' classes with a language-model head (families/registry.py)


@dataclass(frozen=True)
class ModelConfig:
    model_class: Literal[MODEL_CLASSES] = "Qwen3_5ForCausalLM"
    """The transformers class to train (any class with a language-model head parallelize_cp supports). `config`
    holds its family's text config fields (`Family.text_config`: Qwen3_5TextConfig, Qwen3_5MoeTextConfig,
    Qwen3NextConfig); the multimodal classes train on text and take their vision tower's fields in
    `vision_config`. MoE: set `output_router_logits: true` in `config` to add router_aux_loss_coef x the (global)
    auxiliary loss to the loss."""
    vision_config: dict = field(default_factory=dict)
    """Vision tower fields (the family's `Family.vision_config`, e.g. Qwen3_5VisionConfig) of a
    ...ForConditionalGeneration model; empty: transformers' defaults (a full-size tower that text batches leave unused:
    the trainer warns, naming its parameter count). An error for the text-only classes."""
    pretrained: str | None = None
    """A local transformers checkpoint directory (config.json + safetensors, e.g. a released Qwen3.5 checkpoint: the
    text model of a multimodal one is read for a text model_class); no network. Loaded with
    `deltacp.load_pretrained`: built on the meta device, each rank reading only its shard. Excludes `config`."""
    preset: str | None = None
    """A released Qwen3.5 dense size (0.8B, 2B, 4B, 9B, 27B; deltacp.models.presets): its Qwen3_5TextConfig
    fields (vocabulary 248,320), randomly initialised; `config` fields override them. Excludes `pretrained`."""
    config: dict = field(default_factory=dict)
    """Qwen3_5TextConfig fields (e.g. hidden_size, layer_types); keys are checked against the class."""
    gate_init: Literal["default", "long_memory"] = "default"
    """long_memory: slowly decaying GDN heads (deltacp.models.gates), so state hand-over between ranks matters;
    models built from `config` only (with `pretrained` it is an error: it would overwrite trained gates)."""


@dataclass(frozen=True)
class DataConfig:
    source: Literal["stdlib", "files"] = "stdlib"
    """stdlib: this interpreter's standard library .py files (no network); files: `paths` (.txt/.py/.md or .jsonl)."""
    paths: list = field(default_factory=list)
    """Files or directories for source=files; directories are searched for .txt, .md, .py and .jsonl."""
    jsonl_field: str = "text"
    """Field holding the document text in .jsonl files."""
    tokenizer: str = "bytes"
    """bytes (vocab 256, one token per byte) or a local Hugging Face tokenizer directory."""
    seq_len: int = 512
    """Global sequence length (tokens per sequence, before the CP split); divisible by cp (by 2 x cp with
    train.accelerator.sequence_layout balanced)."""
    batch_size: int = 1
    """Rows per step over all dp groups: the GLOBAL batch, the same at every (dp, cp), so a run's data does not
    depend on its layout. Divisible by dp: dp group g trains on rows [g*b, (g+1)*b), b = batch_size / dp, each
    CP rank of the group on its slice of every row."""
    packing: bool = False
    """true: each row of seq_len tokens holds whole documents back to back (one split at the row end continues in
    the next row as a new document), described by cu_seqlens: no token attends to or carries state from another
    document, and no target crosses a document boundary. A dp group's b packed rows are trained as one row of
    b x seq_len tokens (the rows' cu_seqlens joined: the same documents, so the same loss and gradients);
    batch_size = dp gives one packed row per dp group. false: documents joined with a separator into one
    stream, cut into rows."""


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    """Max total grad norm (clip_grad_norm_ over FSDP2 DTensor grads); null: no clipping (norm still reported)."""


@dataclass(frozen=True)
class ScheduleConfig:
    kind: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 0
    """Linear warm-up from lr/warmup_steps to lr."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at the last step."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory (torch.distributed.checkpoint, one sub-directory per saved step); null: none."""
    interval: int = 0
    """Save every `interval` steps (and at the last step); 0: only at the last step (if dir is set)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `dir`, if there is one (the run continues under its run id)."""
    keep: int = 2
    """Complete checkpoints of this run kept (its older ones are deleted); 0 keeps all."""
    overwrite: bool = False
    """With resume false: delete the checkpoints already in `dir` at start. Without it, resume false into a `dir`
    that holds checkpoints is an error (they belong to another run: never deleted nor resumed silently)."""


@dataclass(frozen=True)
class LoggingConfig:
    interval: int = 1
    """Progress line every `interval` steps (rank 0)."""
    progress: Literal["auto", "bar", "line", "none"] = "auto"
    """bar: one updating line (a TTY); line: one line per log step; auto: bar on a TTY, else line."""
    metrics_file: str | None = None
    """JSON lines of every step's metrics (rank 0); null: none."""


@dataclass(frozen=True)
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """auto: nccl on CUDA, gloo on CPU. gloo with CUDA lets several ranks share one GPU (staged via host)."""
    timeout_s: float = 300.0
    """Process-group timeout: a dead peer or a stuck collective fails with a one-line error after this."""
    fsdp: bool = True
    """FSDP2 over the CP mesh (gradient sum = single-device gradient); false: replicated params, all-reduced grads."""


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    """Seeds the model init and the data order."""
    steps: int = 100
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Parameter/compute dtype. bfloat16: fp32 master weights, bf16 params in compute, fp32 gradient reduction."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available (one GPU per local rank, shared round-robin if fewer), else cpu."""
    activation_checkpointing: Literal["none", "full", "selective", "auto"] = "none"
    """full: recompute every decoder layer in backward (non-reentrant torch.utils.checkpoint); selective: the same,
    but each full attention's output and log-sum-exp are kept, so the attention forward is never recomputed (one
    attention output more per attention layer); auto: checkpoint as few decoder layers as the memory budget allows,
    under full or selective, from an estimate of every layer's activations (`deltacp.train.memory`), logged on
    rank 0."""
    activation_checkpointing_budget_gib: float | None = None
    """auto: the memory budget of one rank in GiB (null: activation_checkpointing_budget_fraction of its device's
    memory, divided among the ranks of the node that share the device; required on CPU)."""
    activation_checkpointing_budget_fraction: float | None = None
    """auto: the budget as a fraction of the device's memory, in (0, 1] (null: 0.9)."""
    loss: Literal["linear_cross_entropy", "cross_entropy"] = "linear_cross_entropy"
    """linear_cross_entropy: `cp_causal_lm_loss`, the LM head and the loss in token chunks with the gradients formed
    in the forward, no [tokens, vocab] logits; cross_entropy: the model's logits, then `cp_cross_entropy`. Same value
    and gradients (up to rounding)."""
    accelerator: AcceleratorConfig = field(default_factory=AcceleratorConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def validate_world(self, world_size: int) -> None:
        """Checks that need the world size; every rank runs them before the first collective."""
        hint = (" (a world of one process, as without --spawn or torchrun: start N ranks with --spawn N on CPU, or "
                "torchrun --nproc-per-node N)" if world_size == 1 else "")
        try:
            self.accelerator.validate(world_size)
        except (ValueError, NotImplementedError) as exc:
            raise type(exc)(f"{exc}{hint}") from None
        dp = self.accelerator.data_parallel(world_size)
        derived = ", derived as world // cp" if self.accelerator.dp is None else ""
        if self.data.batch_size % dp:
            raise ConfigError(f"train.data.batch_size ({self.data.batch_size}) must be divisible by "
                              f"train.accelerator.dp ({dp}{derived}): batch_size is the global batch, "
                              f"batch_size / dp rows per dp group")

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------


def _check_scalar(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            if isinstance(value, str) and value in REFUSED:  # a class deltacp refuses: why (train.model.model_class)
                raise ConfigError(f"{key}={value!r} is not supported: {REFUSED[value]}")
            raise ConfigError(f"{key}={value!r} is not supported; expected one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_scalar(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if hint in (dict,) or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(value) if hint is tuple or origin is tuple else list(value)
    raise ConfigError(f"{key}: unsupported type {hint}")


def _build(cls, raw: Any, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix} must be a mapping, got {raw!r}")
    if cls is AcceleratorConfig:
        try:
            return AcceleratorConfig.from_dict(raw)
        except TypeError as exc:
            raise ConfigError(f"{prefix}: {exc}") from None
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown key; allowed keys in {prefix} are {sorted(known)}")
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        key, hint = f"{prefix}.{f.name}", hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = _build(hint, raw[f.name], key)
        else:
            values[f.name] = _check_scalar(key, raw[f.name], hint)
    return cls(**values)


_OWN_ATTENTION = ("the trainer always applies CP, whose full attention layers run deltacp's Ulysses attention "
                  "(torch scaled_dot_product_attention) whatever transformers' attention implementation says")
REMOVED_KEYS = {"train.model.attn_implementation": _OWN_ATTENTION,
                "train.model.config.attn_implementation": _OWN_ATTENTION}


def _check_removed(raw: dict) -> None:
    for dotted, why in REMOVED_KEYS.items():
        *parents, last = dotted.split(".")[1:]
        node = raw
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            raise ConfigError(f"{dotted}: unknown key (removed: {why}); delete it")


def _check_finite(value, key: str) -> None:
    """Every number in a nested mapping/list (e.g. train.model.config) is finite."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def check_model_config_keys(fields_: dict, prefix: str = "train.model.config",
                            config_class: str = "Qwen3_5TextConfig") -> None:
    import transformers

    known = set(getattr(transformers, config_class)().to_dict()) - {"attn_implementation", "_attn_implementation"}
    unknown = sorted(set(fields_) - known)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown {config_class} field")


def model_config_fields(model: ModelConfig) -> dict:
    """The text-config fields of a model built from `preset` and/or `config` (config wins)."""
    from deltacp.models.presets import qwen3_5_preset

    base = qwen3_5_preset(model.preset) if model.preset is not None else {}
    fields_ = {**base, **model.config}
    if model.preset is not None and "num_hidden_layers" in model.config and "layer_types" not in model.config:
        fields_["layer_types"] = base["layer_types"][: model.config["num_hidden_layers"]]
    return fields_


def check_dtype_fsdp(cfg: TrainConfig) -> None:
    if cfg.dtype == "bfloat16" and not cfg.distributed.fsdp:
        raise ConfigError("train.dtype bfloat16 needs train.distributed.fsdp true (FSDP2 mixed precision keeps "
                          "fp32 master weights)")


DEFAULT_BUDGET_FRACTION = 0.9  # auto activation checkpointing: the budget's share of the device's memory


def check_activation_checkpointing(cfg: TrainConfig) -> None:
    """The budget keys belong to activation_checkpointing=auto, one at a time, in range."""
    gib, fraction = cfg.activation_checkpointing_budget_gib, cfg.activation_checkpointing_budget_fraction
    if cfg.activation_checkpointing != "auto" and (gib is not None or fraction is not None):
        key = "activation_checkpointing_budget_gib" if gib is not None else "activation_checkpointing_budget_fraction"
        raise ConfigError(f"train.{key} is read by train.activation_checkpointing=auto only, not "
                          f"{cfg.activation_checkpointing!r}; remove it or set activation_checkpointing: auto")
    if gib is not None and fraction is not None:
        raise ConfigError("train.activation_checkpointing_budget_gib and train.activation_checkpointing_budget_fraction "
                          "both given: give one budget (GiB, or a fraction of the device's memory)")
    if gib is not None:
        _positive("train.activation_checkpointing_budget_gib", gib)
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"train.activation_checkpointing_budget_fraction must be in (0, 1], got {fraction}")


def config_from_dict(raw: dict) -> TrainConfig:
    if not isinstance(raw, dict) or set(raw) != {"train"}:
        extra = sorted(set(raw) - {"train"}) if isinstance(raw, dict) else raw
        raise ConfigError(f"the config must have exactly one top-level key 'train' (got {extra})")
    if isinstance(raw["train"], dict):
        _check_removed(raw["train"])
    cfg = _build(TrainConfig, raw["train"], "train")
    _positive("train.steps", cfg.steps)
    _positive("train.data.seq_len", cfg.data.seq_len)
    _positive("train.data.batch_size", cfg.data.batch_size)
    if cfg.accelerator.dp is not None and cfg.data.batch_size % cfg.accelerator.dp:
        raise ConfigError(f"train.data.batch_size ({cfg.data.batch_size}) must be divisible by train.accelerator.dp "
                          f"({cfg.accelerator.dp}): batch_size is the global batch, batch_size / dp rows per dp group")
    _positive("train.optimizer.lr", cfg.optimizer.lr, allow_zero=True)
    _positive("train.schedule.warmup_steps", cfg.schedule.warmup_steps, allow_zero=True)
    _positive("train.checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    _positive("train.checkpoint.keep", cfg.checkpoint.keep, allow_zero=True)
    _positive("train.logging.interval", cfg.logging.interval)
    _positive("train.distributed.timeout_s", cfg.distributed.timeout_s)
    if cfg.optimizer.grad_clip is not None:
        _positive("train.optimizer.grad_clip", cfg.optimizer.grad_clip)
    betas = cfg.optimizer.betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                  for b in betas):
        raise ConfigError(f"train.optimizer.betas must be two numbers in [0, 1), got {list(betas)}")
    _check_finite(cfg.model.config, "train.model.config")
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        raise ConfigError(f"train.schedule.min_lr_ratio must be in [0, 1], got {cfg.schedule.min_lr_ratio}")
    if cfg.model.pretrained is not None and (cfg.model.config or cfg.model.preset is not None):
        raise ConfigError("train.model: give either pretrained (a local directory) or preset/config (fields), not "
                          "both")
    family = family_of(cfg.model.model_class)
    if cfg.model.preset is not None:
        from deltacp.models.presets import QWEN3_5_PRESETS

        if not family.presets:
            preset_classes = [n for f in FAMILIES if f.presets for n in f.trainable_classes()]
            raise ConfigError(f"train.model.preset: the presets are the dense Qwen3.5 sizes (model_class "
                              f"{' or '.join(preset_classes)}), not {cfg.model.model_class}")
        if cfg.model.preset not in QWEN3_5_PRESETS:
            raise ConfigError(f"train.model.preset={cfg.model.preset!r} is not known; expected one of "
                              f"{list(QWEN3_5_PRESETS)}")
    if cfg.model.pretrained is not None and cfg.model.gate_init != "default":
        raise ConfigError(f"train.model.gate_init={cfg.model.gate_init!r} would overwrite the gates (A_log, dt_bias) "
                          f"of the pretrained model in train.model.pretrained; use gate_init: default")
    check_model_config_keys(cfg.model.config, config_class=family.text_config)
    if cfg.model.vision_config:
        if cfg.model.model_class != family.conditional:
            multimodal = [f.conditional for f in FAMILIES if f.conditional is not None]
            raise ConfigError(f"train.model.vision_config is for the multimodal classes "
                              f"({', '.join(multimodal)}), not model_class {cfg.model.model_class}")
        check_model_config_keys(cfg.model.vision_config, "train.model.vision_config", family.vision_config)
    check_dtype_fsdp(cfg)
    check_activation_checkpointing(cfg)
    if cfg.checkpoint.overwrite and cfg.checkpoint.resume:
        raise ConfigError("train.checkpoint.overwrite=true needs train.checkpoint.resume=false (overwrite deletes the "
                          "checkpoints in train.checkpoint.dir instead of resuming them)")
    if cfg.data.source == "files" and not cfg.data.paths:
        raise ConfigError("train.data.paths must list files or directories when train.data.source is 'files'")
    cp = cfg.accelerator.cp
    if cfg.data.seq_len % cp:
        raise ConfigError(f"train.data.seq_len ({cfg.data.seq_len}) must be divisible by train.accelerator.cp ({cp})")
    if cfg.accelerator.sequence_layout == "balanced" and cfg.data.seq_len % (2 * cp):
        raise ConfigError(f"train.data.seq_len ({cfg.data.seq_len}) must be divisible by 2 x train.accelerator.cp "
                          f"({2 * cp}) with train.accelerator.sequence_layout='balanced' (every rank holds two equal "
                          f"pieces of the row)")
    plan = cfg.accelerator.plan
    halo = model_config_fields(cfg.model).get("linear_conv_kernel_dim", 4) - 1  # transformers' default kernel: 4
    cut = plan.row_cut(halo)
    if cfg.data.seq_len < cut.min_row_length(cp):
        raise ConfigError(f"train.data.seq_len ({cfg.data.seq_len}) / {cut.pieces(cp)} pieces (cp {cp}, "
                          f"sequence_layout {plan.sequence_layout!r}) is below the conv halo ({halo} tokens) that mode "
                          f"{plan.linear_attention_cp_mode!r} needs in every piece")
    return cfg


def _apply_override(raw: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like train.key.sub=value")
    dotted, text = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {key} is not a mapping")
    node[keys[-1]] = yaml.safe_load(text)


# What describes a model built from fields; an override naming a pretrained directory replaces them all
_FIELD_MODEL_KEYS = ("preset", "config", "vision_config", "gate_init")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The config of the YAML file `path` with `--set` overrides applied. An override of train.model.pretrained
    (fine-tuning a file's setup from a checkpoint directory, e.g. an export) replaces the file's description of a
    model built from fields (train.model preset, config, vision_config, gate_init) unless an override sets them
    too: the pretrained directory's config.json describes the model. `train.model.pretrained=null` drops nothing."""
    raw = {"train": {}} if path is None else yaml.safe_load(Path(path).read_text()) or {}
    overridden = [a.split("=", 1)[0].strip() for a in overrides]
    pretrained = [yaml.safe_load(a.split("=", 1)[1]) if "=" in a else None for a in overrides
                  if a.split("=", 1)[0].strip() == "train.model.pretrained"]
    if pretrained and pretrained[-1] is not None and isinstance(raw.get("train", {}).get("model"), dict):
        model = raw["train"]["model"]
        for key in _FIELD_MODEL_KEYS:
            if not any(o == f"train.model.{key}" or o.startswith(f"train.model.{key}.") for o in overridden):
                model.pop(key, None)
    for assignment in overrides:
        _apply_override(raw, assignment)
    return config_from_dict(raw)


def config_to_dict(cfg: TrainConfig) -> dict:
    def convert(obj):
        if isinstance(obj, AcceleratorConfig):  # the CP plan's fields flat in the section, as the YAML holds them
            return obj.to_dict()
        if dataclasses.is_dataclass(obj):
            return {f.name: convert(getattr(obj, f.name)) for f in fields(obj)}
        if isinstance(obj, (list, tuple)):
            return [convert(x) for x in obj]
        if isinstance(obj, dict):
            return {k: convert(v) for k, v in obj.items()}
        return obj

    return {"train": convert(cfg)}
