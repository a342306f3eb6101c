"""`parallelize_cp`: context parallelism for a whole linear-recurrent hybrid (any class a model adapter supports), as a short
composition of named steps.

    model = parallelize_cp(model, cp_mesh, linear_attention_cp_mode="p2p")
    batch = shard_batch_for_cp(input_ids, cp_mesh, attention_mask=mask)    # or cu_seqlens= for packed rows
    loss = cp_causal_lm_loss(model, batch.pop("target_ids"), cp_mesh, **batch, use_cache=False)

Steps (one log line each): check every layer on every rank and exchange the configuration once (every rank
raises together); `stop_kernelization` (transformers' hub kernels would put the classes' forwards back at every
train() / eval()); `apply_linear_attention_cp` (the linear-attention style on every `linear_attn`); `apply_full_attention_cp`
(the full attention style on every `self_attn`); on the Triton backend `apply_fused_decoder` (RMSNorm, residual
add + RMSNorm: `models/fused_decoder.py`); `install_input_hooks` (the CP input hook on the text model, on a
multimodal model the vision hook, on a causal-LM / conditional-generation wrapper the hook refusing `labels` and
`logits_to_keep`, and for routed experts the hook making `aux_loss` global); on rotary embeddings whose frequencies
depend on the call's positions ('dynamic', 'longrope'), the batch's largest position (`models/rotary.py`). Experts
are per-token work and stay as they are. Parameters are not sharded: compose FSDP2 on top with `fully_shard_cp` (`models/fsdp.py`), or sum
gradients over the CP group with `all_reduce_cp_grads` when parameters are replicated.
"""

from __future__ import annotations

import contextlib
import functools
import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.mesh import batch_group_of, cp_group_of
from deltacp.models.adapters import ModelAdapter, adapter_for
from deltacp.models.inputs import make_cp_inputs_hook, make_keyword_relay, make_layer_context_hooks, refuse_local_loss
from deltacp.models.moe import make_aux_loss_hook
from deltacp.models.multimodal import make_multimodal_hook
from deltacp.models.rotary import check_rotary, install_global_rotary
from deltacp.parallel.placement import RowCut
from deltacp.parallel.plan import CPPlan
from deltacp.parallel.style import FullAttentionContextParallel, LinearAttentionContextParallel
from deltacp.parallel.two_d import TwoDGroups

logger = logging.getLogger(__name__)

_ROW_CUT = "_deltacp_row_cut"  # set on the text model once CP is applied: how its rows must be cut (RowCut)


def row_cut_of(model: nn.Module) -> RowCut | None:
    """How a CP'd model's rows must be cut (its sequence layout and shortest piece, `placement.RowCut`); None for a
    model `parallelize_cp` has not been applied to. `shard_batch_for_cp(..., model=model)` reads it."""
    return getattr(adapter_for(model).text, _ROW_CUT, None)


_PLAN = "_deltacp_cp_plan"  # set on the text model once CP is applied: its CPPlan (cp known)
_SUSPENDED = "_deltacp_suspended"  # True on the text model while `suspend_cp` holds it


def cp_plan_of(model: nn.Module) -> CPPlan | None:
    """The CPPlan a model was parallelized with (its cp: the mesh's); None when `parallelize_cp` has not been
    applied."""
    return getattr(adapter_for(model).text, _PLAN, None)


def sequence_layout_of(model: nn.Module) -> str | None:
    """The `sequence_layout` a model was parallelized with (None: not parallelized); cut its batches with it."""
    cut = row_cut_of(model)
    return None if cut is None else cut.sequence_layout


def is_parallelized(model: nn.Module) -> bool:
    """Whether `parallelize_cp` has been applied to this model."""
    return row_cut_of(model) is not None


def require_parallelized(model: nn.Module, fn: str) -> None:
    """ValueError naming `fn` and the fix unless CP is applied to `model` and active: a model `parallelize_cp` never
    touched (an RL reference model left unwrapped, say) would run each rank's slice as a sequence of its own and
    give wrong numbers without a word; inside `suspend_cp` the model is the single-device one. NotImplementedError
    for a class no family supports."""
    text = adapter_for(model).text
    if getattr(text, _ROW_CUT, None) is None:
        raise ValueError(f"{fn}: context parallelism is not applied to this {type(model).__name__}: each rank's slice "
                         f"would run as a sequence of its own (wrong log-probabilities and losses). Apply "
                         f"parallelize_cp(model, mesh, ...) first (or load it with deltacp.load_pretrained); an RL "
                         f"reference or old-policy model needs it too")
    if getattr(text, _SUSPENDED, False):
        raise ValueError(f"{fn}: the model is inside suspend_cp (it runs as the single-device model there); call "
                         f"{fn} outside the suspend_cp block")


def refuse_wrapped(model: nn.Module) -> None:
    """A model some other parallelism already wraps: CP must come first (its hooks and the loss scaling assume the
    plain transformers modules; FSDP2 applied before CP averages gradients over the mesh, 1 / cp of the right
    value). Raises naming the wrapper and the order that works."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    order = ("apply parallelize_cp to the unwrapped transformers model, then (optionally) "
             "apply_activation_checkpointing, then fully_shard_cp(model, mesh) for FSDP2 (deltacp's order: CP -> "
             "activation checkpointing -> FSDP2; deltacp.load_pretrained does all three)")
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise ValueError(f"parallelize_cp: the model is wrapped in {type(model).__name__}; {order}")
    wrapped = next((name or type(model).__name__ for name, m in model.named_modules() if isinstance(m, FSDPModule)),
                   None)
    if wrapped is not None:
        raise ValueError(f"parallelize_cp: the model is already sharded by torch's fully_shard (FSDP2, at {wrapped!r}): "
                         f"its gradients would be averaged over the mesh (1 / cp of the single-device gradient); "
                         f"{order}")
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise ValueError(f"parallelize_cp: the model is wrapped by FullyShardedDataParallel (FSDP1); {order}")
    sharded = next((name for name, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if sharded is not None:
        raise ValueError(f"parallelize_cp: parameter {sharded!r} is a DTensor (the model is already distributed, e.g. "
                         f"tensor parallel or FSDP); {order}")


def stop_kernelization(model: nn.Module) -> None:
    """Turn transformers' hub-kernel layers off (`use_kernels`, on by default in `from_pretrained` of transformers
    5.25): they are re-installed on every change between train() and eval() by replacing the instance forwards of
    the decorated modules, the linear mixer among them, which would silently drop its CP forward."""
    if getattr(model, "use_kernels", False):
        model.use_kernels = False
        logger.info("Turned off transformers' hub kernels of %s (their re-kernelization on train()/eval() would "
                    "replace the CP forwards)", type(model).__name__)


def check_model(model: nn.Module, adapter: ModelAdapter, linear: LinearAttentionContextParallel,
                full: FullAttentionContextParallel, cp: int) -> dict:
    """Every layer checked for its style (raises naming the setting); the configuration every rank must share."""
    text = adapter.text
    layers = adapter.layers()
    config = dict(model=type(model).__name__, family=adapter.family.name, hidden_size=text.config.hidden_size,
                  layer_types=tuple(text.config.layer_types[: len(layers)]), moe=adapter.moe is not None)
    if adapter.family.check_config is not None:
        adapter.family.check_config(text.config)
    for i, layer in enumerate(layers):
        gdn, attention = adapter.linear_attention(layer), adapter.full_attention(layer)
        kind = text.config.layer_types[i]
        if gdn is None and attention is None:
            if kind in ("linear_attention", "full_attention", "hybrid"):
                expected = " nor a ".join(filter(None, (adapter.family.linear_mixer, adapter.family.attention)))
                raise NotImplementedError(f"decoder layer {i} of {type(model).__name__} ({kind}) has no {expected}")
            continue  # a token-wise block (Nemotron-H's mlp / moe layers): nothing to make CP
        try:
            layer_config = {}  # a layer may hold both (Falcon-H1 runs them in parallel)
            for style, module in ((linear, gdn), (full, attention)):
                if module is not None:
                    layer_config.update(style.check_module(module, cp))
        except (ValueError, NotImplementedError) as e:  # the same error, saying which layer
            raise type(e)(f"decoder layer {i} ({kind}): {e}") from None
        config.update({f"layer{i}.{key}": value for key, value in layer_config.items()})
    token_layers = adapter.family.token_layers
    if token_layers is not None:
        attribute, check, _ = token_layers
        for i, layer in enumerate(layers):
            module = getattr(layer, attribute, None)
            if module is not None:
                config.update({f"layer{i}.{attribute}.{key}": value for key, value in check(module).items()})
    return config


def _install_on_layers(adapter: ModelAdapter, module_of, style, group, groups) -> int:
    """`style.install` on the module `module_of(layer)` of every decoder layer that has one; how many."""
    modules = [m for m in map(module_of, adapter.layers()) if m is not None]
    for module in modules:
        style.install(module, group, groups)
    return len(modules)


def apply_linear_attention_cp(adapter: ModelAdapter, style: LinearAttentionContextParallel, group, groups) -> int:
    n = _install_on_layers(adapter, adapter.linear_attention, style, group, groups)
    logger.info("Applied %s linear attention CP (%s backend) to %d linear-recurrent layers", style.mode, style.backend, n)
    return n


def apply_full_attention_cp(adapter: ModelAdapter, style: FullAttentionContextParallel, group, groups, cp: int
                            ) -> int:
    n = _install_on_layers(adapter, adapter.full_attention, style, group, groups)
    logger.info("Applied %s CP (Ulysses degree %d) to %d full attention layers", style.method, style.degree(cp), n)
    return n


def apply_token_layer_cp(adapter: ModelAdapter, group, sequence_layout: str) -> list:
    """The family's per-token windowed layers (`Family.token_layers`: Qwen4-Exp's PLE) given their CP forward."""
    if adapter.family.token_layers is None:
        return []
    attribute, _, install = adapter.family.token_layers
    modules = install(adapter.layers(), group, sequence_layout == "balanced")
    logger.info("Applied the windowed per-token CP forward to %d %s layers", len(modules), attribute)
    return modules


def apply_fused_decoder(model: nn.Module) -> int:
    """The Triton backend's fused decoder glue (the eager backend keeps transformers' forwards: the reference)."""
    from deltacp.models.fused_decoder import install_fused_decoder

    return install_fused_decoder(model)  # logs its line


def _unless_suspended(text: nn.Module, hook):
    """`hook`, a no-op (None: arguments or output unchanged) while `suspend_cp` holds the model of `text`."""

    @functools.wraps(hook)
    def run(*args, **kwargs):
        return None if getattr(text, _SUSPENDED, False) else hook(*args, **kwargs)

    return run


def install_input_hooks(adapter: ModelAdapter, cp_mesh: DeviceMesh, sequence_layout: str = "contiguous") -> None:
    group, text = cp_group_of(cp_mesh), adapter.text
    deliver = None
    if adapter.family.mask_through_layers:  # the context reaches the layers past the text model's mask helper
        deliver, layer_hook = make_layer_context_hooks()
        for layer in adapter.layers():
            layer.register_forward_pre_hook(_unless_suspended(text, layer_hook), with_kwargs=True)
    relay = None
    if not adapter.family.lm_passes_kwargs and adapter.head is not None:  # its forward drops the packing keywords
        relay_hook, relay = make_keyword_relay()
        adapter.head.register_forward_pre_hook(_unless_suspended(text, relay_hook), with_kwargs=True)
    text.register_forward_pre_hook(_unless_suspended(text, make_cp_inputs_hook(group, adapter, sequence_layout,
                                                                               deliver, relay)), with_kwargs=True)
    logger.info("Applied the CP input hook (documents, padding, positions) to %s", type(adapter.text).__name__)
    if adapter.multimodal is not None:
        adapter.multimodal.register_forward_pre_hook(
            _unless_suspended(text, make_multimodal_hook(group, sequence_layout)), with_kwargs=True)
        logger.info("Applied the multimodal CP hook (vision on the whole batch, global mRoPE positions) to %s",
                    type(adapter.multimodal).__name__)
    if adapter.head is not None:
        adapter.head.register_forward_pre_hook(_unless_suspended(text, refuse_local_loss), with_kwargs=True)
        if adapter.moe is not None:
            adapter.head.register_forward_hook(
                _unless_suspended(text, make_aux_loss_hook(adapter.moe.num_experts, adapter.moe.top_k,
                                                           batch_group_of(cp_mesh))), with_kwargs=True)
            logger.info("Applied the global MoE auxiliary loss hook (%d experts, top %d) to %s",
                        adapter.moe.num_experts, adapter.moe.top_k, type(adapter.head).__name__)


def parallelize_cp(model: nn.Module, cp_mesh: DeviceMesh, plan: CPPlan | None = None, **settings) -> nn.Module:
    """Apply CP in place to every layer of a linear-recurrent hybrid (any class `models/adapters.py` supports); return the model.

    On each rank, `model(**shard_batch_for_cp(..., model=model) without target_ids, use_cache=False).logits` is that
    rank's slice of the single-device logits (per document, for packed rows).

    plan: a `CPPlan` (`parallel/plan.py`: every CP setting, validated once; its cp, if given, must be the mesh's), or
    its fields as keywords, as in earlier versions: linear_attention_cp_mode (ulysses | p2p | all_gather),
    linear_attention_backend (eager | triton), full_attention_cp ('ulysses': heads split cp ways, the heads
    must divide by cp; 'all_gather' ('allgather' accepted) or 'ring': no head limit), ulysses_degree (None / cp:
    the 1-D layout; u < cp dividing cp: the 2-D layout, `parallel/layout.py`), linear_attention_state_passing
    ('chain' | 'scan', `parallel/scan.py`), sequence_layout ('contiguous' | 'balanced', `parallel/placement.py`; the
    batch is cut with the same, `shard_batch_for_cp(..., model=model)`). An int in the plan's place is the
    ulysses_degree of the older positional signature.
    """
    # one rank calling twice: raised here, before any collective the others would never join
    if any(getattr(m, _ROW_CUT, None) is not None for m in model.modules()):
        raise ValueError("parallelize_cp: this model is already parallelized; apply CP once, to the single-device "
                         "model")
    if isinstance(plan, int) and not isinstance(plan, bool):  # parallelize_cp(model, mesh, ulysses_degree)
        plan, settings = None, dict(settings, ulysses_degree=plan)
    group = cp_group_of(cp_mesh)
    cp = group.size()
    adapter = linear = full = None
    config = {}
    with LocalChecks() as checks:  # every check first; a check failing on some ranks must not leave others waiting
        plan = CPPlan.resolve(plan, settings, cp)
        config = plan.settings()
        linear, full = plan.styles()
        refuse_wrapped(model)
        adapter = adapter_for(model)
        config.update(check_model(model, adapter, linear, full, cp))
        check_rotary(adapter.text)
    raise_together(group, "parallelize_cp", checks.error, agree=config)

    stop_kernelization(model)
    linear_groups = linear.groups(cp_mesh)
    apply_linear_attention_cp(adapter, linear, group, linear_groups)
    shared = linear_groups if isinstance(linear_groups, TwoDGroups) else None
    apply_full_attention_cp(adapter, full, group, full.groups(cp_mesh, shared), cp)
    apply_token_layer_cp(adapter, group, plan.sequence_layout)
    if plan.linear_attention_backend == "triton":
        if adapter.family.fused_decoder:
            apply_fused_decoder(model)
        else:
            logger.info("The fused Triton decoder glue computes the (1 + w) RMSNorm; %s's decoder norms are another "
                        "form: its decoder layers keep transformers' forwards (the mixers run the Triton backend)",
                        adapter.family.name)
    install_input_hooks(adapter, cp_mesh, plan.sequence_layout)
    text = adapter.text
    rotary = install_global_rotary(text, group, lambda: getattr(text, _SUSPENDED, False))
    if rotary:
        logger.info("Rotary frequencies from the whole batch's largest position (one all-reduce per forward) on %s",
                    ", ".join(rotary))
    setattr(adapter.text, _ROW_CUT, row_cut(config, plan))
    setattr(adapter.text, _PLAN, plan)
    logger.info("Applied CP: %s", plan.describe())
    return model


def row_cut(config: dict, plan: CPPlan) -> RowCut:
    """The model's RowCut from its checked configuration: every piece holds at least what the plan's linear-attention mode needs
    of the longest conv halo of the model's linear-recurrent layers (`CPPlan.min_piece_length`)."""
    halos = [value for key, value in config.items() if key.endswith(".conv_halo")]
    cut = plan.row_cut(max(halos, default=0))
    # a per-token window reads its halo from the previous piece in every mode
    window = max((value for key, value in config.items() if key.endswith(".token_halo")), default=1)
    return RowCut(cut.sequence_layout, max(cut.min_piece_length, window))


@contextlib.contextmanager
def suspend_cp(model: nn.Module):
    """Inside, a model made CP by `parallelize_cp` runs as the single-device model on every rank: transformers' own
    layer forwards on whatever each rank passes (whole sequences), inference caches allowed, nothing exchanged
    between ranks; on exit the CP forwards are back. For generation with the model being trained (e.g. an RL
    trainer's rollouts: each rank generates its own prompts). Parameters stay as they are: under FSDP2 every
    forward all-gathers them, unless `unsharded_parameters` holds them (`models/fsdp.py`). Not re-entrant across
    threads; nested calls are no-ops.
    """
    adapter = adapter_for(model)
    text = adapter.text
    if getattr(text, _ROW_CUT, None) is None:
        raise ValueError("suspend_cp: the model is not parallelized (parallelize_cp first)")
    if getattr(text, _SUSPENDED, False):
        yield model
        return
    token_attribute = None if adapter.family.token_layers is None else adapter.family.token_layers[0]
    # once each: a token layer's attribute may hold the layer's attention (RecurrentGemma's temporal_block)
    mixers = list({id(m): m for layer in adapter.layers()
                   for m in (adapter.linear_attention(layer), adapter.full_attention(layer),
                             getattr(layer, token_attribute or "", None))
                   if m is not None and "forward" in m.__dict__}.values())
    saved = [(m, m.__dict__.pop("forward")) for m in mixers]  # the CP forwards, installed on the instances
    setattr(text, _SUSPENDED, True)
    try:
        yield model
    finally:
        setattr(text, _SUSPENDED, False)
        for module, forward in saved:
            module.forward = forward
