"""transformers' `Trainer` and TRL's `SFTTrainer` under dp x cp with deltacp: a mixin placed before the trainer.

    trainer = CPSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tok, cp_size=4)
    trainer.train()                     # torchrun --nproc-per-node 8 train.py: dp 2 x cp 4

`CPTrainerBase` holds what every deltacp trainer integration shares (keywords, mesh, model, FSDP2, data sharding by
dp rank, gradient sync, evaluation gathering, saving, the common refusals); `CPTrainerMixin` adds the language-model
loss of `Trainer` / `SFTTrainer`, `integrations/grpo.py`'s `CPGRPOMixin` TRL's GRPO. What they do, in the trainer's
own hooks (after the trainer's __init__ has prepared the model, before the optimizer exists):

- mesh: ("dp", "cp") over the whole world, dp = world // cp_size; `parallelize_cp` on the trainer's model;
  `activation_checkpointing` (alias `gradient_checkpointing`) becomes deltacp's per-decoder-layer non-reentrant
  checkpointing (p2p layers replay their received state), applied after CP and before FSDP2, in place of
  transformers' own (the argument is then set to False so that the trainer does not apply its own on top);
  activation_checkpointing_kwargs may give `every_n_layers`, and `policy` ("full", the default; "selective": each
  full attention's output kept, `models/checkpointing.py`) or `selective=True`;
- parameters: deltacp's FSDP2 over dp x cp with summed gradients (`fully_shard_cp`, the default, `fsdp=True`;
  `bf16=True` becomes FSDP2 mixed precision, bf16 compute, fp32 master weights and reduction), or replicated
  parameters whose gradients are summed over dp x cp after the last micro-batch (`fsdp=False`). Either way the
  reduced gradient is the single-device gradient, and accelerate is told not to wrap the model again (no DDP);
- data: the trainer's data loaders are sharded by dp rank instead of world rank, so every CP rank of a dp group
  reads the same batches; each micro-batch is cut by `shard_collated_batch` (padded or padding-free packed rows)
  for the model (its sequence layout, and padded up to its shortest row);
- loss: deltacp's fused linear cross entropy (no [tokens, vocab] logits), the mean over every valid target of the
  step: divided by the count of the whole gradient-accumulation step over dp x cp (transformers'
  `num_items_in_batch`, counted the way deltacp cuts targets) when the trainer normalises that way, else the
  micro-batch's global mean, which the trainer divides by the accumulation steps. The value on every rank is the
  global value, so the trainer's logged loss and grad norm are the single-device ones;
- evaluation: the loss of each batch over its dp group's CP ranks, gathered over dp in the trainer's order
  (`eval_loss` as on one device); `save_model` writes a normal transformers directory, with FSDP2 through
  `deltacp.save_pretrained` (each rank's shard streamed to the saving rank, never the whole model on one rank);
- a model loaded by `deltacp.load_pretrained(path, init_cp_mesh(cp_size, dp), ...)` (built on the meta device, each
  rank reading its shard) is taken as it is: CP and FSDP2 were applied while loading, with the same cp_size and CP
  keywords as the trainer's (refused otherwise; bf16: load with FSDP2 mixed precision, `mp_policy=`).

The CP keywords are checked at construction, before the trainer prepares its datasets; at `train()` every rank
checks that all plan the same steps. Anything the mixin cannot honour raises ValueError / NotImplementedError naming
it, before any training.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
import torch.distributed as dist

from deltacp.distributed.agree import raise_together
from deltacp.distributed.mesh import init_cp_mesh
from deltacp.models.checkpointing import DEFAULT_POLICY, CheckpointingPlan, check_policy
from deltacp.models.compose import parallelize_and_shard
from deltacp.models.fsdp import all_reduce_cp_grads
from deltacp.losses import cp_causal_lm_loss
from deltacp.models.parallelize import cp_plan_of, is_parallelized
from deltacp.parallel.plan import RENAMED, CPPlan
from deltacp.checkpoint_io.save import save_pretrained
from deltacp.integrations.batch import IGNORE_INDEX, CPBatch, shard_collated_batch

logger = logging.getLogger(__name__)

NUM_TOKENS = "_deltacp_num_tokens"  # a CPBatch's input token count (TRL's num_tokens), popped before the model call


def checkpointing_arguments(**kwargs) -> dict:
    """The training arguments that turn on (deltacp's) activation checkpointing, under the names the installed
    transformers uses: `activation_checkpointing` / `_kwargs` where TrainingArguments has them (newer releases, where
    `gradient_checkpointing` is a deprecated alias), `gradient_checkpointing` / `_kwargs` before (5.17 among them).
    `kwargs` (every_n_layers, policy, selective) go to the `_kwargs` field.

        SFTConfig(..., **checkpointing_arguments(policy="selective"))"""
    from dataclasses import fields

    from transformers import TrainingArguments

    name = ("activation_checkpointing" if "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}
            else "gradient_checkpointing")
    return {name: True, **({f"{name}_kwargs": kwargs} if kwargs else {})}


def trainer_checkpointing(args) -> tuple[bool, dict]:
    """(on, kwargs) of the trainer's activation checkpointing, read under either transformers' name."""
    name = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    return bool(getattr(args, name)), dict(getattr(args, f"{name}_kwargs", None) or {})


def checkpointing_policy(kwargs: dict) -> str:
    """deltacp's checkpointing policy from activation_checkpointing_kwargs: `policy` ("full" | "selective") or
    `selective` (a bool: False is "full"); deltacp's default (DEFAULT_POLICY) when neither is given."""
    policy, selective = kwargs.get("policy"), kwargs.get("selective")
    if selective is not None and not isinstance(selective, bool):
        raise ValueError(f"activation_checkpointing_kwargs selective={selective!r} must be true or false")
    if policy is not None:
        check_policy(policy, "activation_checkpointing_kwargs policy")
        if selective is not None and selective != (policy == "selective"):
            raise ValueError(f"activation_checkpointing_kwargs policy={policy!r} and selective={selective!r} "
                             f"disagree: give one of them")
        return policy
    return DEFAULT_POLICY if selective is None else ("selective" if selective else "full")


def mark_prepared_for_accelerate(model: torch.nn.Module) -> None:
    """Keep accelerate from wrapping a model deltacp has already distributed.

    With more than one process, `Accelerator.prepare` wraps a model in DistributedDataParallel (and refuses DTensor
    parameters). A deltacp model is already distributed (CP forwards; FSDP2 or replicated parameters whose gradients
    the mixin sums itself), so it is marked the way accelerate marks what it has prepared itself (and what it
    prepares for tensor parallelism): its `prepare_model` then registers the model and returns it unchanged. This
    attribute, `_is_accelerate_prepared` (accelerate 1.16), is the one private name the integration sets; no
    public hook of the Trainer skips the wrap.
    """
    model._is_accelerate_prepared = True


def _has_dtensors(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def refusal(out: list[str], condition, message: str) -> None:
    """Append `message` to the list of refusals when `condition` holds."""
    if condition:
        out.append(message)


def raise_refusals(problems: list[str]) -> None:
    """One ValueError naming every refused setting (raised on every rank alike: each computes the same list)."""
    if problems:
        raise ValueError("deltacp: not supported under context parallelism:\n  - " + "\n  - ".join(problems))


class CPTrainerBase:
    """What deltacp's trainer integrations share; not used alone: `CPTrainerMixin` (transformers' `Trainer`, TRL's
    `SFTTrainer`) and `CPGRPOMixin` (TRL's `GRPOTrainer`) put it after themselves in the MRO.

    Keywords (every other keyword goes to the trainer): cp_size (ranks per sequence; world = dp x cp_size), plan (a
    `deltacp.CPPlan`: every CP setting) or its fields as keywords (linear_attention_cp_mode,
    linear_attention_backend, full_attention_cp, ulysses_degree, linear_attention_state_passing,
    sequence_layout, as `deltacp.parallelize_cp`), checked at construction; batches are cut by the model's RowCut;
    fsdp (True: deltacp's FSDP2 over dp x cp; False: replicated parameters).
    """

    def __init__(self, *args, cp_size: int, plan: CPPlan | None = None, fsdp: bool = True, **kwargs):
        # Every CP setting is checked here, before the trainer prepares its datasets (which can take minutes)
        if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
            raise ValueError(f"deltacp: cp_size must be a positive integer, got {cp_size!r}")
        if not isinstance(fsdp, bool):
            raise ValueError(f"deltacp: fsdp must be True or False, got {fsdp!r}")
        if "cp" in kwargs:
            raise TypeError("deltacp: the CP degree is cp_size (the trainer's keyword), not cp")
        settings = {name: kwargs.pop(name) for name in (*CPPlan.setting_names(), *RENAMED) if name in kwargs}
        try:  # the rules that need no model
            self.cp_plan = CPPlan.resolve(plan, settings, cp_size, "the CP trainer", cp_name="cp_size")
        except (ValueError, NotImplementedError, TypeError) as e:
            raise type(e)(f"deltacp: {e}") from None
        self._refuse_empty_datasets(args, kwargs)
        self.cp_size, self.cp_fsdp = cp_size, fsdp
        super().__init__(*args, **kwargs)
        self._setup_cp()

    def _refuse_empty_datasets(self, args, kwargs) -> None:
        """An empty train or eval dataset would surface later as a bare StopIteration of the trainer's preparation."""
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        datasets = dict(train_dataset=bound.get("train_dataset"))
        evals = bound.get("eval_dataset")
        datasets.update({f"eval_dataset[{k!r}]": v for k, v in evals.items()} if isinstance(evals, dict)
                        else dict(eval_dataset=evals))
        for name, dataset in datasets.items():
            if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == 0:
                raise ValueError(f"deltacp: {name} is empty (0 rows): nothing to train or evaluate on")

    # -- set-up --------------------------------------------------------------------------------------------------
    @classmethod
    def _cp_verified_classes(cls) -> tuple[type, ...]:
        """The trainer classes this integration is verified on (what may follow CPTrainerBase in the MRO)."""
        raise NotImplementedError

    def _setup_cp(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("deltacp: the CP trainer needs torch.distributed (launch with torchrun or accelerate "
                               "launch, one process per device)")
        world = dist.get_world_size()
        if world % self.cp_size:
            raise ValueError(f"deltacp: the world size ({world}) must be a multiple of cp_size ({self.cp_size})")
        self.dp_size = world // self.cp_size
        raise_refusals(self._cp_refusals())
        self.cp_mesh = init_cp_mesh(self.cp_size, self.dp_size, self.args.device.type)
        self.dp_rank = self.cp_mesh.get_local_rank("dp")
        self._cp_prepare_model(self.model, train=True)  # batches are then cut by the model's RowCut
        logger.info("deltacp: dp %d x cp %d, %s", self.dp_size, self.cp_size,
                    "FSDP2 over dp x cp (summed gradients)" if self.cp_fsdp else "replicated parameters")

    def _cp_prepare_model(self, model: torch.nn.Module, *, train: bool) -> None:
        """The composition every deltacp trainer applies (`parallelize_and_shard`: CP, then for the trained model
        deltacp's activation checkpointing, then FSDP2 or nothing), unless deltacp.load_pretrained applied it while
        loading (then only the checkpointing asked of the trainer); marked prepared for accelerate."""
        args = self.args
        checkpointing = None
        on, kw = trainer_checkpointing(args)
        if train and on:
            checkpointing = CheckpointingPlan(checkpointing_policy(kw), int(kw.get("every_n_layers", 1)))
            # the trainer would apply transformers' own checkpointing on top at train(): deltacp's replaces it
            for name in ("activation_checkpointing", "gradient_checkpointing"):
                if hasattr(args, name):
                    setattr(args, name, False)
        if is_parallelized(model):
            if checkpointing is not None:
                checkpointing.apply(model)
        else:
            mp_policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
            parallelize_and_shard(model, self.cp_mesh, self.cp_plan, fsdp=self.cp_fsdp,
                                  activation_checkpointing=checkpointing or False,
                                  mp_policy=mp_policy if self.cp_fsdp else None)
        mark_prepared_for_accelerate(model)

    def _cp_refusals(self) -> list[str]:
        """What this trainer, its arguments, model and data ask for that the CP trainer cannot honour (each
        integration adds its own)."""
        from torch.utils.data import IterableDataset

        args, out = self.args, []

        def refuse(condition, message):
            refusal(out, condition, message)

        known = self._cp_verified_classes()
        mro = type(self).__mro__
        for cls in mro[mro.index(CPTrainerBase) + 1:]:
            if cls is not object and cls not in known:
                out.append(f"trainer class {cls.__name__} (this CP trainer replaces the hooks of "
                           f"{', '.join(k.__name__ for k in known)} only; other trainers have losses of their own)")
                break
        model = self.model
        refuse(type(model).__name__.startswith("Peft") or hasattr(model, "peft_config"),
               "PEFT models (CP applies to the transformers model itself)")
        checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.2x; the older name
        if checkpointing is None:                                             # warns in those versions
            checkpointing = getattr(model, "is_gradient_checkpointing", False)
        refuse(checkpointing,
               "a model with transformers' activation checkpointing enabled: set the training argument "
               "activation_checkpointing instead (deltacp applies its own per-layer checkpointing)")
        text = getattr(getattr(model, "config", None), "get_text_config", lambda: None)()
        refuse(bool(getattr(text, "output_router_logits", False)),
               "the MoE auxiliary loss (output_router_logits / router_aux_loss_coef): set router_aux_loss_coef=0.0")
        if is_parallelized(model):  # loaded by deltacp.load_pretrained: CP and FSDP2 applied while loading
            loaded, mine = cp_plan_of(model).settings(), self.cp_plan.settings()
            differ = {k: loaded[k] for k, v in mine.items() if loaded[k] != v}
            refuse(differ, f"a model loaded by deltacp.load_pretrained with {differ}: give the trainer the same "
                           f"cp_size and CP keywords")
            refuse(self.cp_fsdp != _has_dtensors(model), f"fsdp={self.cp_fsdp} with a model loaded with "
                                                         f"fsdp={not self.cp_fsdp}")
            refuse(args.bf16 and _has_dtensors(model), "bf16=True with a model loaded by deltacp.load_pretrained: "
                   "pass mp_policy=dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) to load_pretrained")
        refuse(self.is_deepspeed_enabled, "DeepSpeed")
        refuse(self.is_fsdp_enabled or bool(args.fsdp),
               "the trainer's own FSDP (args.fsdp): deltacp shards the model itself, fsdp=True (the default)")
        refuse(args.parallelism_config is not None or getattr(self.accelerator, "parallelism_config", None) is not None,
               "accelerate's parallelism_config (its own context / tensor / sequence parallelism)")
        refuse(args.n_gpu > 1, "nn.DataParallel (several GPUs in one process): launch one process per device")
        refuse(args.fp16 or args.fp16_full_eval, "fp16: use bf16 (FSDP2 mixed precision)")
        refuse(args.bf16 and not self.cp_fsdp, "bf16 with fsdp=False: deltacp's bf16 is FSDP2 mixed precision "
                                               "(fsdp=True), or load the model in bfloat16 yourself")
        refuse(args.bf16_full_eval, "bf16_full_eval")
        refuse(self.model_init is not None, "model_init / hyperparameter search")
        refuse(self.cp_fsdp and (self.optimizer is not None or self.lr_scheduler is not None),
               "optimizers=(...) with fsdp=True (FSDP2 replaces the parameters): pass optimizer_cls_and_kwargs")
        refuse(args.neftune_noise_alpha is not None, "neftune_noise_alpha (its noise scales with each rank's length)")
        refuse(args.include_num_input_tokens_seen not in ("no", False),
               "include_num_input_tokens_seen (it would count each token on every CP rank)")
        refuse(args.torch_compile, "torch_compile")
        refuse(args.use_liger_kernel, "use_liger_kernel")
        refuse(args.auto_find_batch_size, "auto_find_batch_size")
        acc = args.accelerator_config
        refuse(acc.split_batches, "accelerator_config.split_batches")
        refuse(acc.dispatch_batches, "accelerator_config.dispatch_batches")
        datasets = [self.train_dataset] + (list(self.eval_dataset.values()) if isinstance(self.eval_dataset, dict)
                                           else [self.eval_dataset])
        refuse(any(isinstance(d, IterableDataset) or type(d).__name__ == "IterableDataset" for d in datasets),
               "iterable (streaming) datasets: give a map-style dataset")
        save = str(getattr(args.save_strategy, "value", args.save_strategy))
        refuse(save != "no" and not args.save_only_model,
               "checkpoints with optimizer state (resuming is not supported yet): set save_only_model=True")
        refuse(args.load_best_model_at_end, "load_best_model_at_end")
        refuse(args.push_to_hub, "push_to_hub")
        refuse(getattr(args, "activation_offloading", False), "activation_offloading")
        on, kw = trainer_checkpointing(args)
        if on:
            every = kw.pop("every_n_layers", 1)
            refuse(not isinstance(every, int) or isinstance(every, bool) or every < 1,
                   f"activation_checkpointing_kwargs every_n_layers={every!r}")
            refuse(kw.pop("use_reentrant", False), "reentrant activation checkpointing (deltacp's is non-reentrant)")
            refuse(kw.pop("offload", False), "activation checkpointing with offload")
            try:
                checkpointing_policy(kw)
            except ValueError as exc:
                out.append(str(exc))
            kw.pop("policy", None)
            kw.pop("selective", None)
            refuse(bool(kw), f"activation_checkpointing_kwargs {sorted(kw)} (deltacp's checkpointing takes "
                             f"every_n_layers, policy ('full' | 'selective'), selective, use_reentrant=False, "
                             f"offload=False)")
        return out

    # -- data ----------------------------------------------------------------------------------------------------
    def get_cp_size(self) -> int:
        """The CP degree: the trainer divides the world by it for its dp size (total batch size, samples seen)."""
        return self.cp_size

    def _shard_by_dp(self, loader):
        """Make the prepared loader shard by dp rank: accelerate's batch sampler shard (world size, world rank) is
        re-pointed at (dp, dp rank), so every CP rank of a dp group reads the same batches in the same order. At
        dp 1 it passes every batch through as one process does (no last batch completed from the first samples)."""
        from accelerate.data_loader import BatchSamplerShard

        for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
            if isinstance(sampler, BatchSamplerShard):
                sampler.num_processes, sampler.process_index = self.dp_size, self.dp_rank
                if self.dp_size == 1:
                    sampler.even_batches = False
                return loader
        if dist.get_world_size() == 1:
            return loader
        raise RuntimeError(f"deltacp: cannot shard this data loader by dp rank (no accelerate BatchSamplerShard in "
                           f"{type(loader).__name__})")

    def get_train_dataloader(self):
        return self._shard_by_dp(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._shard_by_dp(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._shard_by_dp(super().get_test_dataloader(test_dataset))

    # -- gradients -----------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        sync = self.accelerator.sync_gradients
        if self.cp_fsdp:  # FSDP2 reduce-scatters on the last micro-batch only (as accelerate's no_sync)
            each = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
            self.accelerator.unwrap_model(model).set_requires_gradient_sync(bool(sync or each))
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.cp_fsdp and sync:
            all_reduce_cp_grads(self.accelerator.unwrap_model(model), self.cp_mesh)
        return loss

    # -- evaluation ----------------------------------------------------------------------------------------------
    def _cp_gather_for_metrics(self, tensor, use_gather_object=False):
        """gather_for_metrics over dp (the CP ranks of a dp group hold the same values): dp-rank order, the
        duplicated samples of the last batch dropped as accelerate does."""
        if use_gather_object or not isinstance(tensor, torch.Tensor):
            raise NotImplementedError("deltacp: only loss tensors are gathered in evaluation under CP")
        parts = [torch.empty_like(tensor) for _ in range(self.dp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.cp_mesh.get_group("dp"))
        data = torch.cat(parts)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[: state.remainder]
        return data

    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = self._cp_gather_for_metrics  # the trainer resets it at the end of every loop
        return super().evaluation_loop(*args, **kwargs)

    # -- training entry and saving -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        if resume_from_checkpoint not in (None, False):
            raise NotImplementedError("deltacp: resuming from a checkpoint is not supported under CP yet")
        if trial is not None:
            raise NotImplementedError("deltacp: hyperparameter search trials are not supported under CP")
        self._agree_on_plan()
        return super().train(ignore_keys_for_eval=ignore_keys_for_eval)

    def _agree_on_plan(self) -> None:
        """Every rank plans the same number of steps: the same dataset lengths and step settings everywhere (a rank
        whose dataset is longer would run on alone into collectives the others never join: a collective mismatch
        over gloo, a hang until the timeout over NCCL). Raises on every rank together, naming what differs."""
        args = self.args
        evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        plan = dict(train_dataset_rows=len(self.train_dataset) if self.train_dataset is not None else -1,
                    eval_dataset_rows=tuple(len(d) if d is not None else -1 for d in evals),
                    max_steps=args.max_steps, num_train_epochs=float(args.num_train_epochs),
                    per_device_train_batch_size=args.per_device_train_batch_size,
                    gradient_accumulation_steps=args.gradient_accumulation_steps,
                    dataloader_drop_last=bool(args.dataloader_drop_last), seed=args.seed)
        raise_together(dist.group.WORLD, "deltacp: the training plan", None, agree=plan)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A normal transformers directory (config, safetensors, the processing class, the training arguments). With
        FSDP2 the weights are written by `deltacp.save_pretrained`: every rank's shard streamed tensor by tensor to
        the saving rank, never the whole model on one rank (a collective: every rank calls this); replicated
        parameters by the saving rank's `save_pretrained`."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if not self.cp_fsdp:
            if self.args.should_save:
                self._save(output_dir)
        else:
            save_pretrained(self.accelerator.unwrap_model(self.model), output_dir)
            if self.args.should_save:  # what the trainer's _save writes beside the weights
                tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
                if tokenizer is not None:
                    tokenizer.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        dist.barrier()


def _lm_trainer_classes() -> tuple[type, ...]:
    """transformers' Trainer and TRL's SFTTrainer (and its base), where TRL is installed."""
    from transformers import Trainer

    known = [Trainer]
    try:
        from trl import SFTTrainer
        from trl.trainer.base_trainer import _BaseTrainer
    except ImportError:
        pass
    else:
        known += [SFTTrainer, _BaseTrainer]
    return tuple(known)


class CPTrainerMixin(CPTrainerBase):
    """Context parallelism (deltacp) for a transformers `Trainer` or TRL `SFTTrainer`: put it first,
    `class MyTrainer(CPTrainerMixin, SFTTrainer)`, and pass `cp_size` (see the module docstring and
    `CPTrainerBase` for the keywords). The loss is deltacp's fused linear cross entropy."""

    @classmethod
    def _cp_verified_classes(cls) -> tuple[type, ...]:
        return _lm_trainer_classes()

    def _cp_refusals(self) -> list[str]:
        args, out = self.args, super()._cp_refusals()

        def refuse(condition, message):
            refusal(out, condition, message)

        refuse(self.compute_loss_func is not None, "compute_loss_func (the loss is deltacp's fused cross entropy)")
        refuse(self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None,
               "compute_metrics / preprocess_logits_for_metrics (they need full logits; evaluation gives eval_loss)")
        refuse(bool(args.include_for_metrics), "include_for_metrics")
        refuse(args.label_smoothing_factor != 0, "label_smoothing_factor")
        refuse(not args.average_tokens_across_devices and self.dp_size > 1,
               "average_tokens_across_devices=False with dp > 1 (the loss is the mean over every target of the "
               "global batch, as on one device)")
        refuse(args.train_sampling_strategy == "batch_rebalance", "train_sampling_strategy='batch_rebalance'")
        refuse(getattr(args, "loss_type", "nll") not in ("nll", "chunked_nll"),
               f"loss_type={getattr(args, 'loss_type', None)!r}")
        return out

    # -- data ----------------------------------------------------------------------------------------------------
    def _cp_shard(self, batch) -> CPBatch:
        """This rank's slice of a collated batch, carrying (under NUM_TOKENS, popped before the model call) the
        batch's input token count as TRL's SFTTrainer counts it: the attention mask's ones, else the packed row's
        length (before deltacp pads it)."""
        if isinstance(batch, CPBatch):
            return batch
        pad = getattr(self.processing_class, "pad_token_id", None)
        cut = shard_collated_batch(batch, self.cp_mesh, pad_token_id=pad if isinstance(pad, int) else 0,
                                   model=self.accelerator.unwrap_model(self.model))
        mask, positions = batch.get("attention_mask"), batch.get("position_ids")
        cut[NUM_TOKENS] = (int(mask.sum()) if mask is not None else
                           positions.shape[1] if positions is not None else batch["input_ids"].numel())
        return cut

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, each cut to this rank's CP slice, and the count of every valid target of the
        step over dp x cp (transformers' num_items_in_batch, counted on deltacp's targets)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(self._cp_shard(next(epoch_iterator)))
            except StopIteration:
                break
        if not batches:
            return batches, None
        count = sum((b["target_ids"] != IGNORE_INDEX).sum() for b in batches).reshape(1).to(device, torch.int64)
        dist.all_reduce(count)  # the mesh is the whole world: every dp group's targets, once per CP rank each
        return batches, count

    # -- loss ----------------------------------------------------------------------------------------------------
    def _cp_loss(self, model, batch: CPBatch, mesh, num_items_in_batch):
        """The loss; for a trainer that logs token metrics (TRL's SFTTrainer: `_metrics`), also its entropy,
        mean_token_accuracy and num_tokens, over the whole global batch as TRL gathers them."""
        kwargs = dict(batch)
        target_ids = kwargs.pop("target_ids")
        num_tokens = kwargs.pop(NUM_TOKENS, 0)
        model = self.accelerator.unwrap_model(model)
        metrics = getattr(self, "_metrics", None)
        if metrics is None:
            return cp_causal_lm_loss(model, target_ids, mesh, num_items_in_batch=num_items_in_batch,
                                     use_cache=False, **kwargs)
        loss, stats = cp_causal_lm_loss(model, target_ids, mesh, num_items_in_batch=num_items_in_batch,
                                        use_cache=False, return_token_stats=True, **kwargs)
        # every rank's targets once; the batch's tokens once per CP rank of its dp group
        totals = torch.cat([stats.double(), torch.tensor([float(num_tokens)], device=stats.device,
                                                         dtype=torch.float64)])
        dist.all_reduce(totals)
        entropy_sum, correct, valid, tokens = totals.tolist()
        mode = "train" if self.model.training else "eval"
        metrics[mode]["entropy"].append(entropy_sum / valid if valid > 0 else 0.0)
        metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += round(tokens / self.cp_size)
        metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise NotImplementedError("deltacp: compute_loss(return_outputs=True): no logits exist under CP (the loss "
                                      "is fused with the LM head)")
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # the trainer's own rule: the model normalises by num_items_in_batch when it accepts it
            scaled = self.model_accepts_loss_kwargs
        return self._cp_loss(model, self._cp_shard(inputs), self.cp_mesh,
                             num_items_in_batch if scaled else None)

    # -- evaluation ----------------------------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The batch's loss over its dp group (the mean over the batch's targets, as the trainer's per-batch loss)."""
        if not prediction_loss_only:
            raise NotImplementedError("deltacp: predictions (logits) are not gathered under CP; evaluation gives the "
                                      "loss (prediction_loss_only)")
        inputs = self._prepare_inputs(inputs)
        if inputs.get("labels") is None and not isinstance(inputs, CPBatch):
            return None, None, None
        with torch.no_grad():
            loss = self._cp_loss(model, self._cp_shard(inputs), self.cp_mesh["cp"], None)
        return loss.detach(), None, None

    def predict(self, *args, **kwargs):
        raise NotImplementedError("deltacp: predict() returns logits, which are not gathered under CP; use evaluate() "
                                  "for the loss")
