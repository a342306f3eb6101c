"""Fused Triton decoder glue (`deltacp.ops.fused.decoder`) installed on a model's instances: what
`parallelize_cp` does on the Triton path (`linear_attention_backend="triton"`); the eager backend keeps
transformers' own forwards, the readable reference.

    install_fused_decoder(model)   # any class models/adapters.py supports; returns the number of layers
    remove_fused_decoder(model)    # back to the classes' forwards (before any later wrapper, e.g. checkpointing)

Installed as instance `forward`s only (as the CP forwards are): classes, parameters, state_dict keys and
`save_pretrained` stay transformers' own. Per decoder layer:
  - input_layernorm, post_attention_layernorm: `rms_norm` (the (1 + w) Qwen3.5 form);
  - the MLP stays transformers' own (dense SwiGLU and routed experts alike): the fused `swiglu` kernel measured
    slower than transformers' two kernels on the H200 (NOTES.md), so it is not installed;
  - the layer: the same steps as transformers' decoder layer, calling the layer's own submodules, with the
    residual add and post_attention_layernorm as one `add_rms_norm`. Every keyword the layer receives reaches
    the token mixer as transformers passes it; the cache (the layer's `cache` or `past_key_values`, by transformers
    version) goes under the name the mixer's forward takes.
and the text model's final norm. The kernels load at the first fused forward: on tensors they cannot run on (the CPU without
TRITON_INTERPRET=1) that forward raises the Triton path's documented device error, where triton is missing its
documented not-installed error; never transformers' computation instead.
Activation checkpointing (`train.trainer.apply_activation_checkpointing`) wraps
whatever `layer.forward` is when it is applied: after this, so it checkpoints the fused forward.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types

import torch
from torch import nn

from deltacp.models.adapters import adapter_for
from deltacp.ops.fused import check_device

logger = logging.getLogger(__name__)


def _ops(name: str, x: torch.Tensor):
    """The kernels' module, after the one device rule of the Triton path (`ops.fused.check_device`: CUDA, or any
    device under TRITON_INTERPRET=1; elsewhere the documented device error, never transformers' code instead) and
    the documented error where triton is not installed."""
    check_device(name, x)
    from deltacp.ops.gdn.triton.version import _triton_version

    _triton_version()
    from deltacp.ops.fused import decoder  # imports triton

    return decoder


def _norm_forward(self, hidden_states):
    return _ops("hidden_states", hidden_states).rms_norm(hidden_states, self.weight, self.eps)


def _layer_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                   cache=None, **kwargs):
    past = kwargs.pop("past_key_values", None)  # the layer's cache keyword before transformers 5.2x
    if cache is not None and past is not None:
        raise ValueError("decoder layer: both cache and past_key_values given")
    cache = cache if cache is not None else past
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    linear = getattr(self, "linear_attn", None)
    if linear is not None:
        hidden_states = linear(hidden_states=hidden_states, attention_mask=attention_mask,
                               **{self._deltacp_cache_keyword: cache}, **kwargs)
    else:
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, position_embeddings=position_embeddings,
                                          **{self._deltacp_cache_keyword: cache}, **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, residual = _ops("hidden_states", hidden_states).add_rms_norm(hidden_states, residual, norm.weight,
                                                                               norm.eps)
    hidden_states = self.mlp(hidden_states)
    if isinstance(hidden_states, tuple):  # MoE blocks of some versions return (hidden, router logits)
        hidden_states, _ = hidden_states
    return residual + hidden_states


_FORWARDS = (_norm_forward, _layer_forward)


def _cache_keyword(mixer: nn.Module) -> str:
    """`cache` (transformers >= 5.2x and deltacp's CP forwards), else the mixer's older name."""
    try:
        params = inspect.signature(mixer.forward).parameters
    except (TypeError, ValueError):
        return "cache"
    for name in ("cache", "cache_params", "past_key_values"):
        if name in params:
            return name
    return "cache"


def _is_fused(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) in _FORWARDS


def _install(module: nn.Module, fn) -> None:
    if "forward" in module.__dict__ and not _is_fused(module):
        raise ValueError(f"install_fused_decoder: {type(module).__name__} already has an instance forward "
                         f"({module.__dict__['forward']!r}); install the fused glue before other wrappers")
    module.forward = types.MethodType(fn, module)


def install_fused_decoder(model: nn.Module) -> int:
    """Install the fused norm / residual-add + norm forwards on every decoder layer and the final norm of
    a supported model (in place). Returns the number of decoder layers. Installing twice is a no-op."""
    adapter = adapter_for(model)
    text = adapter.text
    layers = adapter.layers()
    norm = adapter.family.norm  # (x * rsqrt(mean(x^2) + eps) * (1 + w)).type_as(x): the fused kernels' form
    for i, layer in enumerate(layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            if type(getattr(layer, name)).__name__ != norm:
                raise NotImplementedError(f"decoder layer {i}: {name} is {type(getattr(layer, name)).__name__}, "
                                          f"not the {adapter.family.name} family's {norm}")
    if type(text.norm).__name__ != norm:
        raise NotImplementedError(f"final norm {type(text.norm).__name__} is not the {adapter.family.name} family's "
                                  f"{norm}")
    for layer in layers:
        _install(layer.input_layernorm, _norm_forward)
        _install(layer.post_attention_layernorm, _norm_forward)
        mixer = adapter.linear_attention(layer)
        layer._deltacp_cache_keyword = _cache_keyword(mixer if mixer is not None else adapter.full_attention(layer))
        _install(layer, _layer_forward)
    _install(text.norm, _norm_forward)
    logger.info("Installed the fused Triton decoder glue (rms_norm, add_rms_norm) on %d decoder layers and the final "
                "norm of %s", len(layers), type(text).__name__)
    return len(layers)


def remove_fused_decoder(model: nn.Module) -> int:
    """Restore the classes' forwards where the fused ones are installed; returns the number of modules restored.
    Raises if a later wrapper (e.g. activation checkpointing's) holds a fused forward: remove that first."""
    adapter = adapter_for(model)
    modules = [adapter.text.norm]
    for layer in adapter.layers():
        modules += [layer, layer.input_layernorm, layer.post_attention_layernorm]
    for module in modules:
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and any(
                getattr(a, "__func__", None) in _FORWARDS for a in (forward.func, *forward.args)):
            raise ValueError(f"remove_fused_decoder: {type(module).__name__}'s fused forward is wrapped "
                             f"({forward!r}); remove that wrapper first")
    n = 0
    for module in modules:
        if _is_fused(module):
            del module.forward
            module.__dict__.pop("_deltacp_cache_keyword", None)
            n += 1
    return n


def fused_decoder_installed(model: nn.Module) -> bool:
    return _is_fused(adapter_for(model).text.norm)
