"""The training job: a Qwen3.5 hybrid under context parallelism (+ FSDP2), driven by the trainer YAML.

Order of application (one log line each, as in torchtitan; `parallelize_and_shard`): CP on every layer
(`parallelize_cp`), activation checkpointing per decoder layer, FSDP2 last (`fully_shard_cp`, gradient divide
factor 1). A pretrained model (`train.model.pretrained`) goes through `load_pretrained`: the same composition on the
meta device, then each rank reads only its shard of the checkpoint (never the whole model on a rank).
The mesh is 2-D, ("dp", "cp"), dp = world // cp unless train.accelerator.dp is given: CP modules use its "cp"
dimension, FSDP2 shards over dp x cp flattened. Each dp group trains on its rows of the global batch (the data
order is the global batch's, not a rank's). The loss is the mean over every valid token of the global batch:
its all-reduce spans dp x cp (`cp_global_mean`, shared by both train.loss choices: the one place the loss is
scaled) and FSDP2 sums (divide factor 1), so the reduced gradients are the single-device gradients of the global batch.

    trainer = Trainer(cfg)      # after the process group exists; validates before the first collective
    rows = trainer.fit()        # [{step, loss, grad_norm, lr, tokens_per_s, ...}, ...]
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.models.adapters import adapter_for
from deltacp.batching import shard_batch_for_cp
from deltacp.models.checkpointing import CheckpointingPlan
from deltacp.models.compose import parallelize_and_shard
from deltacp.families.registry import family_of
from deltacp.models.fsdp import all_reduce_cp_grads
from deltacp.losses import cp_causal_lm_loss, cp_cross_entropy
from deltacp.checkpoint_io.pretrained import load_pretrained
from deltacp.parallel.style import cp_layer_of
from deltacp.train.checkpoint import (
    CheckpointError,
    claim_directory,
    load_checkpoint,
    new_run_id,
    run_owner,
    save_checkpoint,
)
from deltacp.train.config import ConfigError, TrainConfig, check_dtype_fsdp, model_config_fields
from deltacp.train.data import TokenStream
from deltacp.train.progress import Progress

logger = logging.getLogger(__name__)


@dataclass
class TrainHooks:
    """Test and tooling hooks (not configuration)."""

    on_step_end: Callable[["Trainer", dict], None] | None = None
    before_checkpoint_commit: Callable[[int], None] | None = None


# ---------------------------------------------------------------------------------------------------------------
# Process group and device
# ---------------------------------------------------------------------------------------------------------------


def device_type(cfg: TrainConfig) -> str:
    """cuda or cpu, as train.device says (auto: cuda when available); ConfigError if cuda is asked for and absent."""
    kind = cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but no CUDA device is available")
    return kind


def backend_for(cfg: TrainConfig, device: str) -> str:
    """The process-group backend a new group gets: train.distributed.backend, auto: nccl on CUDA, gloo on CPU."""
    backend = cfg.distributed.backend
    return ("nccl" if device == "cuda" else "gloo") if backend == "auto" else backend


def check_device_backend(cfg: TrainConfig, device: str, backend: str) -> None:
    """The rules between train.device, the backend and train.distributed.fsdp (the launcher checks them with the
    device and backend its ranks will get; every rank again before the first collective)."""
    if backend == "nccl" and device != "cuda":
        raise ConfigError("train.distributed.backend 'nccl' needs train.device cuda")
    if cfg.distributed.fsdp and device == "cuda" and backend == "gloo":
        raise ConfigError("train.distributed.fsdp true needs nccl on CUDA: FSDP2's collectives over gloo with "
                          "CUDA tensors crash (SIGSEGV, torch 2.11, H200); for CP ranks sharing one GPU over "
                          "gloo set train.distributed.fsdp=false (and dtype float32)")


def resolve_device(cfg: TrainConfig) -> torch.device:
    kind = device_type(cfg)
    if kind == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = local_rank % torch.cuda.device_count()  # ranks share GPUs round-robin if there are fewer GPUs
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(cfg: TrainConfig, device: torch.device) -> None:
    """Create the default process group (torchrun's env://) unless one exists; the timeout turns a dead peer or
    a stuck collective into an error instead of a hang. An existing group must use the backend the config names."""
    backend = cfg.distributed.backend
    if dist.is_initialized():
        if backend != "auto" and dist.get_backend() != backend:
            raise ConfigError(f"train.distributed.backend is {backend!r} but this process group uses "
                              f"{dist.get_backend()!r} (--spawn runs gloo ranks; use torchrun for nccl)")
        check_device_backend(cfg, device.type, dist.get_backend())
        return
    backend = backend_for(cfg, device.type)
    check_device_backend(cfg, device.type, backend)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.distributed.timeout_s), **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


def model_config(cfg: TrainConfig):
    """The transformers config of the model `train.model` describes (of a pretrained directory: its config.json,
    read as `from_pretrained` reads it)."""
    import transformers

    family = family_of(cfg.model.model_class)
    model_cls = getattr(transformers, cfg.model.model_class)
    if cfg.model.pretrained is not None:
        config = model_cls.config_class.from_pretrained(cfg.model.pretrained, local_files_only=True)
        check_family_config(family, config, cfg.model.pretrained)
        return eager_experts_in_float64(cfg, config)
    if not cfg.model.config and cfg.model.preset is None:
        raise ConfigError(f"train.model: give preset (a released Qwen3.5 size), config "
                          f"({family.text_config} fields) or pretrained (a local directory)")
    config = getattr(transformers, family.text_config)(**model_config_fields(cfg.model))
    if cfg.model.model_class == family.conditional:
        config = getattr(transformers, family.multimodal_config)(
            text_config=config.to_dict(), vision_config=dict(cfg.model.vision_config) or None,
            tie_word_embeddings=config.tie_word_embeddings)
    check_family_config(family, config, cfg.model.pretrained)
    return eager_experts_in_float64(cfg, config)


def check_family_config(family, config, pretrained) -> None:
    """The family's own refusals of its text config (`Family.check_config`: e.g. Qwen4-Exp's indexed layers without
    the QSA fields, which transformers cannot build), as a ConfigError naming where the config came from, before
    the model is built."""
    if family.check_config is None:
        return
    try:
        family.check_config(config.get_text_config())
    except (ValueError, NotImplementedError) as e:
        where = "train.model.config" if pretrained is None else f"train.model.pretrained ({pretrained})"
        raise ConfigError(f"{where}: {e}") from None


def eager_experts_in_float64(cfg: TrainConfig, config):
    """Routed experts run transformers' eager experts in float64 (grouped_mm has no float64 kernel)."""
    if cfg.dtype == "float64" and getattr(config.get_text_config(), "num_experts", 0):
        config.get_text_config()._experts_implementation = "eager"
        config._experts_implementation = "eager"
    return config


def param_dtype(cfg: TrainConfig) -> torch.dtype:
    """The parameters' dtype: float64 for train.dtype float64, else float32 (bfloat16 computes from fp32 master
    weights through FSDP2 mixed precision)."""
    return torch.float64 if cfg.dtype == "float64" else torch.float32


def check_vocab(config, vocab_size: int) -> None:
    vocab = config.get_text_config().vocab_size
    if vocab < vocab_size:
        raise ConfigError(f"train.model vocab_size ({vocab}) is smaller than the tokenizer's ({vocab_size})")


def model_skeleton(cfg: TrainConfig) -> torch.nn.Module:
    """The model of `build_model` on the meta device (shapes only, no memory, no weights read): what the checks
    before the first rank starts look at."""
    import transformers

    config = model_config(cfg)
    with torch.device("meta"):
        return getattr(transformers, cfg.model.model_class)(config)


def build_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """The single-device transformers model of class `train.model.model_class`, fp32 (fp64 for float64), on CPU,
    identical on every rank. Routed experts use transformers' eager experts in float64 (grouped_mm has no float64
    kernel)."""
    import transformers

    model_cls = getattr(transformers, cfg.model.model_class)
    torch.manual_seed(cfg.seed)
    if cfg.model.pretrained is not None:
        model = model_cls.from_pretrained(cfg.model.pretrained, local_files_only=True, config=model_config(cfg),
                                          dtype=param_dtype(cfg))
    else:
        model = model_cls(model_config(cfg))
    check_vocab(model.config, vocab_size)
    if cfg.model.gate_init == "long_memory":
        from deltacp.models.gates import long_memory_gates_

        long_memory_gates_(model)
    return model.to(param_dtype(cfg))


def default_vision_tower_note(cfg: TrainConfig, model: torch.nn.Module) -> str | None:
    """A warning when a multimodal class is built from fields without `train.model.vision_config`: transformers then
    builds its default vision tower, which text batches never run (GLM-5.3-Flash has no causal-LM class, so a text
    model of it is always this class); None otherwise."""
    family = family_of(cfg.model.model_class)
    if cfg.model.pretrained is not None or cfg.model.vision_config or cfg.model.model_class != family.conditional:
        return None
    n = sum(p.numel() for name, p in model.named_parameters() if ".visual." in f".{name}")
    return (f"train.model.vision_config is empty: {cfg.model.model_class} holds transformers' default vision tower "
            f"({n:,} parameters), which text batches leave unused (it is still sharded, optimised and saved); "
            f"give train.model.vision_config ({family.vision_config} fields) for a smaller one")


def checkpointing_budget(cfg: TrainConfig, device: torch.device) -> int:
    """Bytes one rank may hold under train.activation_checkpointing=auto: the budget in GiB, or the fraction (default
    0.9) of its CUDA device's memory, shared evenly by the ranks of this node that use the device (LOCAL_WORLD_SIZE
    ranks round-robin over the visible GPUs, as `resolve_device` places them); ConfigError on CPU without a budget in
    GiB."""
    from deltacp.train.config import DEFAULT_BUDGET_FRACTION

    if cfg.activation_checkpointing_budget_gib is not None:
        return int(cfg.activation_checkpointing_budget_gib * 2 ** 30)
    if device.type != "cuda":
        raise ConfigError(f"train.activation_checkpointing=auto on {device.type} needs "
                          f"train.activation_checkpointing_budget_gib (there is no device memory to take a fraction of)")
    fraction = cfg.activation_checkpointing_budget_fraction or DEFAULT_BUDGET_FRACTION
    sharing = -(-int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // torch.cuda.device_count())
    return int(fraction * torch.cuda.get_device_properties(device).total_memory / sharing)


def plan_checkpointing(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, dp: int, world: int):
    """The auto activation checkpointing plan of this job (`deltacp.train.memory`), from the config and the model's
    parameter counts: this rank's tokens (its dp group's rows, 1/cp of them), the activation dtype, the static
    memory of parameters, gradients and AdamW states (sharded over the world under FSDP2), the budget."""
    from deltacp.train.memory import LayerShapes, plan_activation_checkpointing, static_bytes

    acc, data = cfg.accelerator, cfg.data
    adapter = adapter_for(model)
    rows = data.batch_size // dp
    e = {"float32": 4, "float64": 8, "bfloat16": 2}[cfg.dtype]
    layer_params = tuple(sum(p.numel() for p in layer.parameters()) for layer in adapter.layers())
    other = sum(p.numel() for p in model.parameters()) - sum(layer_params)
    static = static_bytes(layer_params, other, param_bytes=8 if cfg.dtype == "float64" else 4, compute_bytes=e,
                          world=world, fsdp=cfg.distributed.fsdp)
    return plan_activation_checkpointing(
        LayerShapes.of(adapter.text_config), tokens=rows * data.seq_len // acc.cp, activation_bytes=e,
        static_bytes=static, budget_bytes=checkpointing_budget(cfg, device),
        row_tokens=rows * data.seq_len if data.packing else data.seq_len, gathered_tokens=rows * data.seq_len,
        backend=acc.linear_attention_backend, full_attention_cp=acc.full_attention_cp)


def p2p_passings(model: torch.nn.Module) -> list:
    """The StatePassing of every p2p GDN layer, in layer order (their `log` lists record messages)."""
    out = []
    adapter = adapter_for(model)
    for layer in adapter.layers():
        gdn = adapter.linear_attention(layer)
        cp_layer = None if gdn is None else cp_layer_of(gdn)
        if cp_layer is not None and cp_layer.passing is not None:
            out.append(cp_layer.passing)
    return out


def lr_lambda(cfg: TrainConfig, step: int) -> float:
    """Multiplier of the peak lr for the 0-based optimizer step."""
    sched, warmup = cfg.schedule, cfg.schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if sched.kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return sched.min_lr_ratio + (1 - sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def total_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Total L2 norm of all gradients (DTensor grads reduced over the mesh); clips in place if max_norm is set."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    # foreach None: torch's choice (the multi-tensor kernels on CUDA; a loop on the CPU, where the foreach path's
    # DTensor dispatch costs each new model's first step 0.3-1 s a rank and the result is the same)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=None)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=None)
    return norm


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig, *, hooks: TrainHooks | None = None, progress: bool = True,
                 device: torch.device | None = None):
        self.cfg, self.hooks = cfg, hooks or TrainHooks()
        self.device = device or resolve_device(cfg)
        init_distributed(cfg, self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg.validate_world(self.world)  # before the first collective
        check_dtype_fsdp(cfg)
        acc = cfg.accelerator
        # dp groups of cp consecutive ranks; CP modules use the "cp" dimension, FSDP2 and the loss's all-reduce
        # the whole mesh (dp x cp flattened)
        self.dp, self.cp = acc.data_parallel(self.world), acc.cp
        self.mesh = init_device_mesh(self.device.type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.data = TokenStream(cfg.data, cfg.seed)

        plan = acc.plan  # every CP setting (train.accelerator's CPPlan)
        fsdp = cfg.distributed.fsdp
        mp_policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.dtype == "bfloat16" else None
        checkpointing = self.checkpointing_plan(cfg)
        if cfg.model.pretrained is not None:  # built on the meta device, each rank reads its shard
            config = model_config(cfg)
            check_vocab(config, self.data.tokenizer.vocab_size)
            model = load_pretrained(cfg.model.pretrained, self.mesh, dtype=param_dtype(cfg), fsdp=fsdp,
                                    model_class=cfg.model.model_class, config=config,
                                    activation_checkpointing=checkpointing or False, mp_policy=mp_policy,
                                    device=self.device, plan=plan).train()
        else:
            model = build_model(cfg, self.data.tokenizer.vocab_size).to(self.device)
            note = default_vision_tower_note(cfg, model)
            if note and self.rank == 0:
                logger.warning(note)
            parallelize_and_shard(model, self.mesh, plan, fsdp=fsdp, activation_checkpointing=checkpointing or False,
                                  mp_policy=mp_policy)
        if fsdp:
            logger.info("Applied FSDP2 over dp %d x cp %d = %d ranks, flattened (mixed precision: %s)", self.dp,
                        self.cp, self.world, mp_policy)
        self.model = model
        self.n_params = sum(p.numel() for p in model.parameters())  # FSDP2's DTensors: their global numel
        opt = cfg.optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                           weight_decay=opt.weight_decay)  # foreach: torch's choice, as above
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(lr_lambda, cfg))
        self.step_count = 0
        self.run_id: str | None = None  # set when the checkpoint directory is prepared (fit)
        self.session: str | None = None  # this process's claim on the checkpoint directory (rank 0)
        self.progress = Progress(cfg.steps, mode=cfg.logging.progress, interval=cfg.logging.interval,
                                 metrics_file=cfg.logging.metrics_file, enabled=progress and self.rank == 0)

    # -- one step ------------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self) -> dict:
        self._sync()
        start = time.perf_counter()
        # this dp group's rows of the global batch (packed: joined into one row), then this rank's CP slice
        ids, cu_seqlens = self.data.next_step(self.dp_rank, self.dp)
        batch = shard_batch_for_cp(ids.to(self.device), self.mesh, cu_seqlens=cu_seqlens, model=self.model)
        inputs = {k: v for k, v in batch.items() if k != "target_ids"}
        if self.cfg.loss == "linear_cross_entropy":  # the LM head and the loss chunk by chunk: no full logits
            loss = cp_causal_lm_loss(self.model, batch["target_ids"], self.mesh, **inputs, use_cache=False)
        else:
            output = self.model(**inputs, use_cache=False)
            loss = cp_cross_entropy(output.logits, batch["target_ids"], self.mesh)
            if getattr(output, "aux_loss", None) is not None:  # routed experts: as cp_causal_lm_loss adds it
                loss = loss + self.model.config.get_text_config().router_aux_loss_coef * output.aux_loss
        loss.backward()
        if not self.cfg.distributed.fsdp:
            all_reduce_cp_grads(self.model, self.mesh)
        grad_norm = total_grad_norm(self.params, self.cfg.optimizer.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value, norm_value = loss.item(), grad_norm.item()
        self._sync()
        seconds = time.perf_counter() - start
        self.step_count += 1
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            raise FloatingPointError(f"non-finite loss ({loss_value}) or grad norm ({norm_value}) at step "
                                     f"{self.step_count}")
        return dict(step=self.step_count, loss=loss_value, grad_norm=norm_value, lr=lr, seconds=seconds,
                    tokens_per_s=ids.numel() * self.dp / seconds)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return dict(step=self.step_count, scheduler=self.scheduler.state_dict(), data=self.data.state_dict(),
                    steps=self.cfg.steps, layout=dict(dp=self.dp, cp=self.cp, sequence_layout=self.cfg.accelerator.sequence_layout))

    def save(self) -> None:
        path = save_checkpoint(self.cfg.checkpoint.dir, self.step_count, self.model, self.optimizer,
                               self.trainer_state(), keep=self.cfg.checkpoint.keep,
                               before_commit=self.hooks.before_checkpoint_commit, run_id=self.run_id,
                               session=self.session)
        self.progress.message(f"saved checkpoint {path}")

    def maybe_resume(self) -> None:
        """Once per trainer, before the first step: decide (rank 0, broadcast) what the checkpoint directory
        means for this run, resume if it says so, and record this run as the directory's owner."""
        ck = self.cfg.checkpoint
        if not ck.dir or self.run_id is not None:
            return
        plan = [plan_checkpoint_dir(self.cfg) if self.rank == 0 else None]
        dist.broadcast_object_list(plan, src=0)
        plan = plan[0]
        if plan["error"]:
            raise ConfigError(plan["error"])
        if plan["damaged"]:
            raise CheckpointError(plan["damaged"])
        if self.rank == 0:
            for old in plan["delete"]:
                shutil.rmtree(old, ignore_errors=True)
        if plan["resume"] is not None:
            state = load_checkpoint(plan["resume"], self.model, self.optimizer)
            manifest = state.pop("manifest")
            self.scheduler.load_state_dict(state["scheduler"])
            self.data.load_state_dict(state["data"])
            self.step_count = state["step"]
            # the data position is global (the same on every rank), so any (dp, cp) continues the same stream
            saved = state.get("layout") or dict(dp=1, cp=manifest.get("world_size"))  # older checkpoints: cp only
            self.progress.message(f"resumed run {plan['run_id']} from {plan['resume']} (step {self.step_count}"
                                  f"{layout_change(saved, self.trainer_state()['layout'])})")
            planned = state.get("steps")
            if planned is not None and planned != self.cfg.steps:  # the schedule is a function of train.steps
                before = self.cfg.optimizer.lr * lr_lambda(dataclasses.replace(self.cfg, steps=planned),
                                                           self.step_count)
                self.progress.message(f"train.steps changed from {planned} to {self.cfg.steps} since the checkpoint: "
                                      f"the learning-rate schedule ({self.cfg.schedule.kind}) is re-planned over "
                                      f"{self.cfg.steps} steps (lr at step {self.step_count}: {before:.3e} under "
                                      f"the old plan, {self.cfg.optimizer.lr * lr_lambda(self.cfg, self.step_count):.3e}"
                                      f" under the new)")
        self.run_id = plan["run_id"]
        failed = [None]
        if self.rank == 0:
            try:
                self.session = claim_directory(ck.dir, self.run_id, plan["resume"])
            except CheckpointError as exc:
                failed[0] = str(exc)
        dist.broadcast_object_list(failed, src=0)  # an unwritable directory stops every rank, none waits
        if failed[0] is not None:
            raise CheckpointError(failed[0])

    # -- the loop ------------------------------------------------------------------------------------------------
    def describe(self) -> str:
        cfg, acc = self.cfg, self.cfg.accelerator
        kinds = "".join("L" if t == "linear_attention" else "F" for t in self.model.config.get_text_config().layer_types)
        source = (f"from {cfg.model.pretrained}" if cfg.model.pretrained else
                  f"preset {cfg.model.preset}, random init" if cfg.model.preset else "from train.model.config, random init")
        return (f"deltacp.train: {cfg.model.model_class} {kinds} ({self.n_params / 1e6:.2f} M params, {source}) "
                f"| dp={self.dp} x {acc.plan.describe(defaults=True)} | {cfg.dtype} | "
                f"AC {self.checkpointing_summary()} | fsdp={cfg.distributed.fsdp} | "
                f"{self.device.type}/{dist.get_backend()} | data {cfg.data.source} ({len(self.data.files)} files), "
                f"{cfg.data.batch_size}x{cfg.data.seq_len} tokens/step"
                f"{' (packed documents)' if cfg.data.packing else ''}")

    def checkpointing_plan(self, cfg: TrainConfig) -> CheckpointingPlan | None:
        """train.activation_checkpointing as a plan; `auto` plans from the model's shapes (on the meta device) and
        the memory budget, the same plan on every rank (else they would recompute apart), logged on rank 0."""
        self.ac_plan = None
        if cfg.activation_checkpointing == "none":
            return None
        if cfg.activation_checkpointing != "auto":
            return CheckpointingPlan(cfg.activation_checkpointing)
        with LocalChecks() as checks:
            self.ac_plan = plan_checkpointing(cfg, model_skeleton(cfg), self.device, self.dp, self.world)
        plan = self.ac_plan
        raise_together(dist.group.WORLD, "train.activation_checkpointing=auto", checks.error,
                       agree=dict(policy=str(plan and plan.policy), num_layers=plan and plan.num_layers))
        if self.rank == 0:
            (logger.info if plan.fits else logger.warning)(plan.describe())
        return None if plan.policy is None else CheckpointingPlan(plan.policy, num_layers=plan.num_layers)

    def checkpointing_summary(self) -> str:
        """`full`, `none`, ..., or for auto its choice: `auto: selective 20/24 layers`."""
        plan = self.ac_plan
        if plan is None:
            return self.cfg.activation_checkpointing
        return f"auto: {plan.policy or 'none'}" + (f" {plan.num_layers}/{plan.total_layers} layers" if plan.policy
                                                   else "")

    def fit(self, max_steps: int | None = None) -> list[dict]:
        """Train to cfg.steps (or stop after `max_steps` more steps, same schedule); returns this call's rows."""
        self.maybe_resume()
        stop = self.cfg.steps if max_steps is None else min(self.cfg.steps, self.step_count + max_steps)
        self.progress.message(self.describe())
        rows = []
        ck = self.cfg.checkpoint
        while self.step_count < stop:
            row = self.train_step()
            rows.append(row)
            self.progress.update(row, self.device)
            if self.hooks.on_step_end is not None:
                self.hooks.on_step_end(self, row)
            last = self.step_count == self.cfg.steps
            if ck.dir and ((ck.interval and self.step_count % ck.interval == 0) or last):
                self.save()
        self.progress.close()
        return rows


def layout_change(saved: dict, now: dict) -> str:
    """What differs between a checkpoint's (dp, cp, sequence layout) and this run's, for the resume message: the
    numbers continue (DCP reshards; the data position is global), but the run now cuts its rows differently."""
    parts = []
    shape, shape_now = f"dp{saved.get('dp')}xcp{saved.get('cp')}", f"dp{now['dp']}xcp{now['cp']}"
    if shape != shape_now:
        parts.append(f"resharded from {shape} to {shape_now}")
    layout = saved.get("sequence_layout", "contiguous")  # checkpoints before the balanced layout: contiguous
    if layout != now["sequence_layout"]:
        parts.append(f"sequence_layout changed from {layout!r} to {now['sequence_layout']!r}")
    return "".join(f", {p}" for p in parts)


def plan_checkpoint_dir(cfg: TrainConfig) -> dict:
    """What train.checkpoint.dir means for a starting run (rank 0 decides, from the files alone):
    {error (a config error), damaged (a CheckpointError's message), resume (path or None), run_id, delete (paths)}.

    resume true: the newest checkpoint is resumed and the run continues under its run id (a newest one without
    .metadata is damaged: an error, never skipped for an older one).
    resume false: a directory holding checkpoints is an error unless overwrite is true (then they are deleted);
    a fresh run gets a new run id."""
    from deltacp.train.checkpoint import checkpoint_dirs, checkpoint_run_id, newest_checkpoint

    ck = cfg.checkpoint
    plan = dict(error=None, damaged=None, resume=None, run_id=new_run_id(), delete=[])
    if ck.resume:
        try:
            newest = newest_checkpoint(ck.dir)
        except CheckpointError as exc:  # raised on every rank (maybe_resume), like any other damaged checkpoint
            plan["damaged"] = str(exc)
            return plan
        if newest is not None:
            plan["resume"] = str(newest[1])
            plan["run_id"] = checkpoint_run_id(newest[1]) or plan["run_id"]
        return plan
    found = checkpoint_dirs(ck.dir)  # damaged ones too: they are another run's as much as the complete ones
    if found and not ck.overwrite:
        try:
            owner = (run_owner(ck.dir) or {}).get("run_id", "unknown")
        except Exception:  # noqa: BLE001  (an unreadable run.json: the message still stands)
            owner = "unknown"
        steps = [s for s, _ in found]
        plan["error"] = (f"train.checkpoint.dir={ck.dir!r} holds {len(found)} checkpoint(s) of run {owner} (steps "
                         f"{steps[0]}..{steps[-1]}) and train.checkpoint.resume is false: this run would neither "
                         f"resume nor keep them; point train.checkpoint.dir to a fresh directory, set "
                         f"train.checkpoint.resume=true to continue that run, or set "
                         f"train.checkpoint.overwrite=true to delete them")
    else:
        plan["delete"] = [str(p) for _, p in found]
    return plan


def with_cp(cfg: TrainConfig, cp: int, mode: str | None = None, dp: int | None = None) -> TrainConfig:
    """The same job at another CP degree (and optionally another mode and dp; dp None: derived from the world
    size); ulysses_degree is kept where it still names a 2-D layout at this cp (divides it, below it), else
    null."""
    u = cfg.accelerator.ulysses_degree
    acc = cfg.accelerator.replace(cp=cp, dp=dp, ulysses_degree=u if u is not None and u < cp and cp % u == 0 else None,
                                  linear_attention_cp_mode=mode or cfg.accelerator.linear_attention_cp_mode)
    return replace(cfg, accelerator=acc)  # replace validates the section again
