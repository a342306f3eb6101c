"""TRL's `GRPOTrainer` under dp x cp with deltacp: reinforcement learning on long rollouts, each prompt + completion
row cut over the ranks of a CP group for the log-probabilities and the training step.

    trainer = CPGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                            processing_class=tokenizer, cp_size=4)
    trainer.train()                     # torchrun --nproc-per-node 8 train.py: dp 2 x cp 4

A dp group (its cp ranks) is what one process is to the plain trainer at dp processes: `per_device_train_batch_size`
rows per micro-batch, `steps_per_generation` micro-batches per generation round, the same prompts, completions,
rewards, advantages, shuffles, losses and metrics. Round by round:

- data: every CP rank of a dp group reads the group's generation batch (`CPTrainerBase`'s dp-sharded loaders);
  GRPOConfig derives `generation_batch_size` from the world (dp x cp processes): the trainer sets it again from dp
  (per_device_train_batch_size x dp x steps_per_generation), so set `steps_per_generation`, not
  `generation_batch_size`, under CP.
- generation: CP rank c takes the c-th of cp equal contiguous shares of those rows and TRL's own
  `_generate_and_score_completions` runs on the share, as if every rank were one process of a world of dp x cp:
  tokenizing, generating, rewards (TRL gathers them over the world: the shares in rank order are the global batch
  in the plain trainer's order, so groups of `num_generations` and their advantages are the same), metrics. No
  completion is generated twice. Generation runs on the model itself, outside CP (`suspend_cp`: transformers' own
  forwards and caches on each rank's whole rows) with its FSDP2 parameters unsharded once for the whole generation
  (`unsharded_parameters`): per round, one all-gather of the parameters (what one training forward costs in
  communication) and, while generating, the full parameters in the compute dtype on every rank plus the inference
  cache of the rank's share at full length (full-attention KV for 1 layer in 4 and constant-size GDN states); so a
  rollout must fit one device for generation, while the training forward and backward, whose activations are what
  outgrows a device, run under CP. Generation has its own random stream per rank (TRL's seed + rank), apart from
  the dp group's stream (TRL's seed + dp rank, as the plain trainer's process), so every CP rank of a group
  shuffles the same way. `rollout_func` receives the rank's share.
- old-policy and reference log-probabilities: asked for the share's rows, the trainer gathers every share of the
  group, computes them under CP for all the group's rows (`cp_token_logprobs`; the reference model is made CP and
  sharded like the model) and returns the share's.
- the scored shares are gathered over the CP group (prompts left-padded, completions right-padded to the widest:
  the tensors one process builds), so every CP rank holds its group's generation batch, which TRL shuffles and
  splits into micro-batches as usual.
- loss: each micro-batch's prompt + completion rows are packed padding-free into one row of documents
  (`padding_free=True`, the default: no compute on padding) or kept as padded rows, cut over the CP group with the
  model's sequence_layout, and `cp_token_logprobs` gives this rank's per-token log-probabilities and entropies
  (no logits); they are gathered into TRL's [B, completion] tensors on every CP rank (`gather_cp_rows`: 8 bytes a
  token) and TRL's `_compute_loss` runs unchanged: every loss type's normaliser (per sequence, per batch, per
  global token count, max_completion_length), clipping, KL to the reference, importance sampling per token or per
  sequence, entropy masks and bonuses, and every metric, on the same tensors as one process. The gather's backward
  keeps each rank's own slice, so the gradients summed over the CP ranks are the loss's; FSDP2 then sums over dp
  where the plain trainer's DDP averages, so the loss's gradient (not its value) is scaled by 1 / dp.

Refused at construction, on every rank, naming the setting: vLLM (`use_vllm`, server and colocate: its weight sync
reads each parameter as a plain tensor, which FSDP2 shards, and colocate keeps a second copy of the model beside the
memory CP exists to save), transformers' continuous batching, `cast_lm_head_to_fp32`, the MoE auxiliary loss,
multimodal processing classes, tools and environments, a generation batch that the CP ranks or the generation
groups cannot split evenly, and what `CPTrainerBase` refuses (PEFT, DeepSpeed, the trainer's own FSDP, ...).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque

import torch
import torch.distributed as dist

from deltacp.distributed.mesh import cp_group_of
from deltacp.integrations.batch import completion_rows, completion_values, shard_collated_batch
from deltacp.integrations.trainer import CPTrainerBase, raise_refusals, refusal
from deltacp.batching import batch_row_cut, gather_cp_rows
from deltacp.models.fsdp import unsharded_parameters
from deltacp.losses import IGNORE_INDEX, cp_token_logprobs
from deltacp.models.parallelize import sequence_layout_of, suspend_cp

logger = logging.getLogger(__name__)

# the scored batch TRL builds per process (GRPOTrainer._generate_and_score_completions, TRL 1.16): per key, the side
# its columns are padded on when shares of different widths are gathered (None: one value per row) and the pad
SCORED_KEYS = {"prompt_ids": ("left", "pad"), "prompt_mask": ("left", 0), "completion_ids": ("right", "pad"),
               "completion_mask": ("right", 0), "old_per_token_logps": ("right", 0.0),
               "ref_per_token_logps": ("right", 0.0), "tool_mask": ("right", 1), "advantages": (None, None),
               "num_items_in_batch": (None, None)}


def _early_refusals(config) -> list[str]:
    """What the GRPOConfig asks for that is refused before GRPOTrainer's own __init__ starts it."""
    out = []
    if config is None:
        return out
    refusal(out, getattr(config, "use_vllm", False),
            f"use_vllm (vllm_mode={getattr(config, 'vllm_mode', None)!r}): vLLM's weight sync reads each parameter as "
            f"a plain tensor, which deltacp's FSDP2 shards, and colocate mode keeps a second copy of the model "
            f"beside the training memory CP saves; CPGRPOTrainer generates with the model itself (each CP rank a "
            f"share of the completions)")
    refusal(out, getattr(config, "use_transformers_continuous_batching", False),
            "use_transformers_continuous_batching (it casts the model in place; not verified under CP)")
    return out


def _grpo_trainer_classes() -> tuple[type, ...]:
    from transformers import Trainer
    from trl import GRPOTrainer
    from trl.trainer.base_trainer import _BaseTrainer

    return GRPOTrainer, _BaseTrainer, Trainer


class CPGRPOMixin(CPTrainerBase):
    """Context parallelism (deltacp) for TRL's `GRPOTrainer`: `class T(CPGRPOMixin, GRPOTrainer)` (that is
    `deltacp.integrations.CPGRPOTrainer`), with GRPOTrainer's arguments plus `cp_size` and the keywords of
    `CPTrainerBase`, and `padding_free` (True: each micro-batch's rows packed into one row of documents for the CP
    forward; False: padded rows as TRL builds them). See the module docstring."""

    def __init__(self, *args, padding_free: bool = True, **kwargs):
        if not isinstance(padding_free, bool):
            raise ValueError(f"deltacp: padding_free must be True or False, got {padding_free!r}")
        config = kwargs.get("args", args[2] if len(args) > 2 else None)  # GRPOTrainer(model, reward_funcs, args)
        raise_refusals(_early_refusals(config))  # what GRPOTrainer's own __init__ would start (a vLLM engine)
        self.cp_padding_free = padding_free
        self._cp_share_rows = False  # True while TRL scores this rank's share of a generation batch
        self._cp_rng_state = None  # the generation's own random stream, between rounds
        super().__init__(*args, **kwargs)

    @classmethod
    def _cp_verified_classes(cls) -> tuple[type, ...]:
        return _grpo_trainer_classes()

    # -- set-up --------------------------------------------------------------------------------------------------
    def _setup_cp(self) -> None:
        from accelerate.utils import set_seed

        super()._setup_cp()
        if self.ref_model is not None:
            self._cp_prepare_model(self.ref_model, train=False)
        args = self.args
        derived, args.generation_batch_size = args.generation_batch_size, self._cp_generation_batch()
        if derived != args.generation_batch_size and dist.get_rank() == 0:
            # GRPOConfig cannot tell us which of the two the user set: say what changed, once
            logger.warning(
                "deltacp GRPO: generation batch = per_device_train_batch_size x dp x steps_per_generation = %d x %d x "
                "%d = %d completions per round (GRPOConfig counted the %d cp ranks as processes: %d). Under CP set "
                "steps_per_generation to generate more per round: a generation_batch_size given to GRPOConfig was "
                "divided by the cp ranks (steps_per_generation=%d would give %d)",
                args.per_device_train_batch_size, self.dp_size, args.steps_per_generation, args.generation_batch_size,
                self.cp_size, derived, max(1, derived // (args.per_device_train_batch_size * self.dp_size)), derived)
        for key, value in self._logs.items():  # TRL sized its completion logs by the world's generation batch
            if isinstance(value, deque):
                self._logs[key] = deque(value, maxlen=args.generation_batch_size)
        set_seed(args.seed + self.dp_rank)  # the dp group's stream: the plain trainer's process seed (TRL's seed + rank)
        logger.info("deltacp GRPO: generation batch %d (%d per dp group, %d generated per rank), %s rows under CP",
                    args.generation_batch_size, args.generation_batch_size // self.dp_size,
                    args.generation_batch_size // self.dp_size // self.cp_size,
                    "packed padding-free" if self.cp_padding_free else "padded")

    def _cp_generation_batch(self) -> int:
        args = self.args
        return args.per_device_train_batch_size * self.dp_size * args.steps_per_generation

    def _cp_refusals(self) -> list[str]:
        args, out = self.args, super()._cp_refusals()

        def refuse(condition, message):
            refusal(out, condition, message)

        out += _early_refusals(args)
        refuse(args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32 (the CP log-probabilities compute the head in the "
                                          "model's compute dtype and reduce in float32)")
        refuse(self.aux_loss_enabled, "the MoE auxiliary loss: set router_aux_loss_coef=0.0")
        refuse(self._is_vlm, "multimodal processing classes (images are not cut under CP)")
        refuse(bool(self.tools) or self.environment_factories is not None,
               "tools / environment_factory (multi-turn rollouts: not verified under CP)")
        cp, rows = self.cp_size, args.per_device_train_batch_size * args.steps_per_generation
        refuse(rows % cp, f"per_device_train_batch_size x steps_per_generation = {rows} (the completions a dp group "
                          f"generates per round) must be divisible by cp_size ({cp}): its CP ranks split them")
        total = self._cp_generation_batch()
        refuse(total % args.num_generations,
               f"the generation batch, per_device_train_batch_size x dp ({self.dp_size}) x steps_per_generation = "
               f"{total}, must be divisible by num_generations ({args.num_generations})")
        if self.eval_dataset is not None:
            per_group, generations = args.per_device_eval_batch_size, args.num_generations_eval or args.num_generations
            refuse(per_group % cp, f"per_device_eval_batch_size ({per_group}) must be divisible by cp_size ({cp})")
            refuse(per_group * self.dp_size % generations,
                   f"per_device_eval_batch_size x dp = {per_group * self.dp_size} must be divisible by the number of "
                   f"generations in evaluation ({generations})")
        return out

    # -- generation and scoring ----------------------------------------------------------------------------------
    def _cp_group(self):
        return cp_group_of(self.cp_mesh)

    def _generate_and_score_completions(self, inputs):
        """TRL's scoring of this rank's share of the group's rows, then every share gathered (module docstring)."""
        n, cp = len(inputs), self.cp_size
        if n % cp:  # the same rows on every CP rank: all raise together
            raise ValueError(f"deltacp: a batch of {n} prompts cannot be split over cp_size={cp} ranks (the last "
                             f"batch of a dataset whose size the batch size does not divide?)")
        c = dist.get_rank(self._cp_group())
        self._cp_share_rows = True
        try:
            scored = super()._generate_and_score_completions(inputs[c * n // cp:(c + 1) * n // cp])
        finally:
            self._cp_share_rows = False
        return self._cp_gather_scored(scored)

    def _cp_gather_scored(self, scored: dict) -> dict:
        unknown = sorted(set(scored) - set(SCORED_KEYS))
        if unknown:
            raise NotImplementedError(f"deltacp: TRL's scored batch has keys {unknown}, which CPGRPOTrainer does not "
                                      f"gather over the CP group")
        pad_id = self.processing_class.pad_token_id
        out = {}
        for key, value in scored.items():
            side, pad = SCORED_KEYS[key]
            if key == "num_items_in_batch":
                # TRL divides this global count by accelerator.num_processes for one process's share; a dp group is
                # one process of the plain trainer, and the world here has cp processes per group
                out[key] = value * self.cp_size
            else:
                out[key] = self._cp_gather_share(value, side, pad_id if pad == "pad" else pad)
        return out

    def _cp_gather_share(self, x: torch.Tensor, side: str | None, pad) -> torch.Tensor:
        """Every CP rank's rows of x, in rank order; columns padded on `side` to the widest share first."""
        group = self._cp_group()
        if side is not None:
            width = torch.tensor([x.shape[1]], device=x.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
            extra = int(width) - x.shape[1]
            if extra:
                fill = x.new_full((x.shape[0], extra, *x.shape[2:]), pad)
                x = torch.cat([fill, x] if side == "left" else [x, fill], dim=1)
        parts = [torch.empty_like(x) for _ in range(self.cp_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @contextlib.contextmanager
    def _cp_generation_rng(self):
        """The generation's random stream of this rank (TRL's per-process seed: seed + rank), kept between rounds,
        apart from the dp group's stream that every CP rank of the group shares."""
        device = self.args.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self._cp_rng_state is None:
                torch.manual_seed(self.args.seed + dist.get_rank())
            else:
                torch.set_rng_state(self._cp_rng_state[0])
                if devices:
                    torch.cuda.set_rng_state(self._cp_rng_state[1], device)
            try:
                yield
            finally:
                self._cp_rng_state = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if devices else None)

    def _generate(self, prompts):
        """TRL's generation of this rank's share, on the model outside CP with its parameters unsharded (no
        generation model is touched for a `rollout_func`)."""
        with self._cp_generation_rng():
            if self.rollout_func is not None:
                return super()._generate(prompts)
            with suspend_cp(self.model), unsharded_parameters(self.model):
                return super()._generate(prompts)

    # -- log-probabilities under CP ------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's [B, logits_to_keep] log-probabilities (and entropies) of the completion tokens, computed under CP;
        while TRL scores a share, for every share of the group at once, this share's returned."""
        given = sorted(key for key, value in multimodal.items() if value is not None)
        if given or compute_aux_loss:
            raise NotImplementedError(f"deltacp: {given or 'the MoE auxiliary loss'} under CP (refused at construction)")
        share = None
        if self._cp_share_rows:
            n, k = input_ids.shape[0], logits_to_keep
            prompt_ids = self._cp_gather_share(input_ids[:, :-k], "left", self.processing_class.pad_token_id)
            prompt_mask = self._cp_gather_share(attention_mask[:, :-k], "left", 0)
            completion_ids = self._cp_gather_share(input_ids[:, -k:], "right", self.processing_class.pad_token_id)
            completion_mask = self._cp_gather_share(attention_mask[:, -k:], "right", 0)
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            logits_to_keep = completion_ids.shape[1]
            c = dist.get_rank(self._cp_group())
            share = (slice(c * n, (c + 1) * n), slice(0, k))
        batch_size = batch_size or input_ids.shape[0]
        logps, entropies = [], []
        for start in range(0, input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            lp, ent = self._cp_completion_logprobs(model, input_ids[rows], attention_mask[rows], logits_to_keep,
                                                   compute_entropy)
            logps.append(lp)
            entropies.append(ent)
        logps = torch.cat(logps)
        entropies = torch.cat(entropies) if compute_entropy else None
        if share is not None:
            logps = logps[share]
            entropies = None if entropies is None else entropies[share]
        return logps, entropies, None

    def _cp_completion_logprobs(self, model, input_ids, attention_mask, logits_to_keep, with_entropy):
        """One chunk of rows: packed or padded, cut over the CP group, log-probabilities (and entropies: 0 where
        nothing is scored, as TRL's) of this rank's tokens, gathered into the whole [B, logits_to_keep]."""
        model = self.accelerator.unwrap_model(model)
        layout, pad = sequence_layout_of(model), self.processing_class.pad_token_id
        batch, index = completion_rows(input_ids, attention_mask, logits_to_keep, padding_free=self.cp_padding_free,
                                       row_cut=batch_row_cut(None, model, "CPGRPOTrainer"), cp=self.cp_size,
                                       pad_token_id=pad)
        cut = dict(shard_collated_batch(batch, self.cp_mesh, pad_token_id=pad, model=model))
        target_ids = cut.pop("target_ids")
        out = cp_token_logprobs(model, target_ids, self.cp_mesh,
                                temperature=self.temperature, return_entropy=with_entropy, use_cache=False, **cut)
        logps, entropies = out if with_entropy else (out, None)
        length = input_ids.shape[1]
        logps = completion_values(gather_cp_rows(logps, self.cp_mesh, layout), index, length, logits_to_keep)
        if entropies is not None:
            entropies = entropies.masked_fill(target_ids == IGNORE_INDEX, 0)
            entropies = completion_values(gather_cp_rows(entropies, self.cp_mesh, layout), index, length,
                                          logits_to_keep)
        return logps, entropies

    def get_high_entropy_mask(self, entropies, mask, threshold):
        """TRL's mask, its quantile taken over every dp group's tokens once: the first CP rank of each group gives
        them (the others an empty mask) and sends the result to the rest of its group."""
        group = self._cp_group()
        first = dist.get_rank(group) == 0
        result = super().get_high_entropy_mask(entropies, mask if first else torch.zeros_like(mask), threshold)
        result = result.to(torch.uint8)
        dist.broadcast(result, group=group, group_src=0)
        return result.bool()

    # -- loss ----------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss (the value: the dp group's, as the plain trainer's process); its gradient scaled by 1 / dp
        (FSDP2 sums the dp groups' gradients where the plain trainer's DDP averages them)."""
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.dp_size == 1:
            return loss
        share = loss / self.dp_size
        return share + (loss - share).detach()
