"""What a CP algorithm sees of a model's layer: a view, never the model class.

The CP algorithms (the linear-attention modes, the full-attention methods) read a layer only through these two
views. Each model family's home (`deltacp.families.<family>`) subclasses them for its module classes and registers
a factory per class here (deltacp's package registers a loader that imports the families before the first lookup);
`parallel/` itself knows no model class, no gate formula and no parameter name. Views read the module's parameters
at call time (FSDP2 swaps a module's parameters between sharded and unsharded tensors around each forward).

LinearMixerView describes a linear-recurrent mixer: its head layout and pre-conv channels (`HeadLayout`), its conv,
the path from projections to the recurrence inputs (`ops/recurrence.py`) and from the recurrence output to the
mixer's output. AttentionView describes a full attention: head counts, and the path from projections to q/k/v and
from attention output to the layer's output.

Shape legend: x_BsD local hidden states; pre_BsC pre-conv channels; extras_BsHX per value head; o_BsHV per value
head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


def _reads(path: str) -> property:
    """A read-only property: `self.module.<path>`, read at every call (FSDP2 swaps parameters between calls)."""
    names = path.split(".")

    def get(self):
        x = self.module
        for name in names:
            x = getattr(x, name)
        return x

    return property(get, doc=f"module.{path}, read at call time")


@dataclass(frozen=True)
class HeadLayout:
    """How a linear mixer's heads and pre-conv channels are laid out: key heads (shared by groups of value heads:
    key head i serves value heads i*r .. (i+1)*r - 1, r = value_heads / key_heads) and value heads; the pre-conv
    channels are `groups` in order, each (kind, dim): `kind` "key" (key_heads x dim channels) or "value"
    (value_heads x dim). A slice of value heads owns its value channels and the key channels of the key heads it
    reads (repeated when the slices do not hold whole key heads, which is exact for a depthwise conv)."""

    key_heads: int
    value_heads: int
    groups: tuple[tuple[str, int], ...]
    key_setting: str = "key heads"  # the config fields that set the head counts, for error messages
    value_setting: str = "value heads"

    @property
    def channels(self) -> int:
        return sum((self.key_heads if kind == "key" else self.value_heads) * dim for kind, dim in self.groups)

    def split(self, parts: int) -> tuple[int, int]:
        """(key heads after any repeat, value heads) of each of `parts` equal slices of the value heads, or
        ValueError naming the setting."""
        if self.value_heads % parts:
            raise ValueError(f"splitting heads {parts} ways needs {self.value_setting} ({self.value_heads}) "
                             f"divisible by {parts}")
        key = self.key_heads if self.key_heads % parts == 0 else self.value_heads
        return key // parts, self.value_heads // parts

    def slice_channels(self, part: int, parts: int, device) -> torch.Tensor:
        """The pre-conv channel indices of value-head slice `part` of `parts`, in the module's channel order."""
        key_local, value_local = self.split(parts)
        value = torch.arange(part * value_local, (part + 1) * value_local, device=device)
        if self.key_heads % parts == 0:
            key = torch.arange(part * key_local, (part + 1) * key_local, device=device)
        else:
            key = value // (self.value_heads // self.key_heads)
        out, base = [], 0
        for kind, dim in self.groups:
            heads, total = (key, self.key_heads) if kind == "key" else (value, self.value_heads)
            out.append(base + (heads[:, None] * dim + torch.arange(dim, device=device)).flatten())
            base += total * dim
        return torch.cat(out)


class LinearMixerView:
    """One linear-recurrent token mixer as the CP algorithms need it: the family's description, subclassed per
    family (its home in `deltacp.families`). The CP layer reads only this:

        layout                      HeadLayout: heads and pre-conv channels
        conv                        the depthwise causal conv over the pre-conv channels (nn.Conv1d), or None:
                                    the mixer has no conv (no halo; the pre-conv channels are the parts as they
                                    are, any activation applied by `project`)
        conv_activation             its activation's name (the CP conv computes "silu"; unread without a conv)
        extras                      per-token inputs per value head that skip the conv (e.g. GDN's b and a)
        state_dims                  (K, V) of one value head's recurrent state (part of the configuration every
                                    rank must agree on; the modes take a piece's state shape from the recurrence,
                                    `Recurrence.state_shape`, whose heads may join several of these: Mamba1's)
        project(x)                  -> (pre_BsC, extras_BsHX [B, s, Hv, extras], out): the module's projections
        reads_positions             project takes the call's position ids too: project(x, position_ids) (the
                                    RG-LRU's resets at position 0, as transformers' module reads them)
        reads_every_head            a head's recurrence inputs read every head's channels (Mamba1's x_proj over
                                    all I channels): `inputs` takes head_sum too, which sums a per-token product
                                    over the given heads' channels across the ranks holding the other heads
                                    (identity where every head is here)
        conv_heads(key_heads)       -> the split of the conv output the backend's conv op makes
        inputs(parts, extras, heads, backend[, head_sum]) -> RecurrenceInputs of value heads `heads` (a slice)
                                    from the conv output parts and the extras of those heads: the family's gate
                                    formula
        recurrence(backend)         -> the Recurrence (`ops/recurrence.py`) the inputs are for
        output(o_BsHV, out, backend) -> the mixer's output [B, s, hidden] (gated norm, output projection), in the
                                    form the module's forward returns it (a tuple where transformers' is one)

    Parameters are read at call time (FSDP2 swaps them between sharded and unsharded tensors)."""

    family = "generic"
    extras = 0
    reads_positions = False
    reads_every_head = False

    def __init__(self, module: nn.Module):
        self.module = module

    conv = _reads("conv1d")

    @property
    def layout(self) -> HeadLayout:
        raise NotImplementedError

    @property
    def conv_activation(self) -> str:
        raise NotImplementedError

    @property
    def state_dims(self) -> tuple[int, int]:
        raise NotImplementedError

    def project(self, x_BsD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        raise NotImplementedError

    def conv_heads(self, key_heads: int) -> tuple[int, ...]:
        raise NotImplementedError

    def inputs(self, parts, extras_BnHX: torch.Tensor, heads: slice, backend):
        raise NotImplementedError

    def recurrence(self, backend):
        raise NotImplementedError

    def output(self, o_BsHV: torch.Tensor, out, backend) -> torch.Tensor:
        raise NotImplementedError

    def eager_only(self, scan: str, backend) -> None:
        """For a recurrence with eager kernels only (`recurrence` calls it): NotImplementedError naming `scan`, the
        backend and the allowed one, unless `backend` is eager."""
        if backend.name != "eager":
            raise NotImplementedError(
                f"{type(self.module).__name__}: {scan} has eager kernels only; linear_attention_backend="
                f"{backend.name!r} is not supported for this family: use linear_attention_backend='eager'")

    def parameter(self) -> torch.Tensor:
        """Any parameter (dtype and device of the module)."""
        return next(self.module.parameters())


GDNView = LinearMixerView  # the name of earlier versions


class AttentionView:
    """One full-attention module as the attention CP methods need it (subclassed per family):

        num_heads, num_kv_heads, head_dim, scaling, dropout
        sliding_window              None (full attention) or the window of a sliding-window layer
        project(x, position_embeddings) -> (q_BsHD, k_BsHD, v_BsHD, out): the local projections, q/k norms and
                                    rotary (position_embeddings None: the family's NoPE layers)
        positions(position_embeddings, position_ids) -> what `project` takes as its second argument: the (cos, sin)
                                    the decoder layer handed over (the default), or the position ids for a module
                                    that forms its own rotary from them (RecurrentGemma's)
        output(o_BsX, out)          -> [B, s, hidden]: any output gate, then the output projection
        call_keywords, for_call(**keywords) -> the view of one call: the keywords of the module's forward the view
                                    reads (Zamba2's layer_idx: the LoRA adapters of the shared block's invocation)
    """

    family = "generic"
    call_keywords: tuple[str, ...] = ()

    def __init__(self, module: nn.Module, apply_rotary: Callable | None = None):
        self.module = module
        self._apply_rotary = apply_rotary

    num_heads = _reads("config.num_attention_heads")
    num_kv_heads = _reads("config.num_key_value_heads")
    head_dim = _reads("head_dim")
    scaling = _reads("scaling")

    @property
    def dropout(self) -> float:
        return self.module.attention_dropout if self.module.training else 0.0

    @property
    def sliding_window(self) -> int | None:
        """A sliding-window layer's window (transformers' `sliding_window` on the module: a query sees itself and the
        window - 1 tokens before it), None for full attention (`parallel/sliding_attention.py`)."""
        return getattr(self.module, "sliding_window", None)

    def positions(self, position_embeddings, position_ids):
        """What `project` takes as its positions (see the class docstring); the default: the layer's (cos, sin)."""
        return position_embeddings

    def apply_rotary(self, q_BsHD: torch.Tensor, k_BsHD: torch.Tensor, position_embeddings):
        """The family's rotary embedding of the local tokens (partial rotary and mRoPE are in cos/sin); None: none."""
        if position_embeddings is None:
            return q_BsHD, k_BsHD
        cos, sin = position_embeddings
        return self._apply_rotary(q_BsHD, k_BsHD, cos, sin, unsqueeze_dim=2)

    def for_call(self, **keywords) -> AttentionView:
        """The view of one call given its `call_keywords` (those the call passed); the default reads none."""
        return self

    def project(self, x_BsD: torch.Tensor, position_embeddings):
        raise NotImplementedError

    def output(self, o_BsX: torch.Tensor, out) -> torch.Tensor:
        raise NotImplementedError


def bind_call(view: AttentionView, keywords: dict) -> AttentionView:
    """`view.for_call` with the view's `call_keywords` taken out of a forward's remaining keywords (`keywords`,
    changed in place: what is left is refused as unsupported)."""
    if not view.call_keywords:
        return view
    return view.for_call(**{key: keywords.pop(key) for key in view.call_keywords if key in keywords})


class IndexedAttentionView(AttentionView):
    """A full attention whose keys each query reads are chosen by an indexer over pooled blocks of the query's
    visible prefix (indexed sparse attention: the top-k indexers of deltacp.families), subclassed per
    family. Blocks are runs of `block_size` consecutive tokens of a document, starting at its first token; a query
    reads the `top_blocks` best-scored complete blocks it sees plus the tail of its incomplete last block. Besides
    `AttentionView`'s attention path (`project`, `output`), the CP method (`parallel/indexed_attention.py`) reads:

        block_size, top_blocks
        pooling                   how a block's key is pooled from its tokens' terms: "sum" (the terms summed) or
                                  "softmax" (terms [logits_BsY | values_BsY]: the values weighted by a softmax of the
                                  logits over the block's tokens, per channel; the sums handed on are [sum of
                                  exp(logit - m) value | sum of exp(logit - m)], m the block's largest logit)
        index(x, position_embeddings, offsets_Bs) -> (iq [B, s, ...], terms_BsX): the indexer's per-token queries
                                  (what `block_scores` takes, sliced by query along dim 1) and the per-token terms
                                  pooled over each block's tokens (compute dtype); offsets_Bs: each token's offset
                                  in its block (-1: in no complete block)
        block_keys(sums_BNX, cos_BNR, sin_BNR) -> [B, N, ...] the block keys from the pooled sums of their tokens'
                                  terms and the rotary cos / sin at each block's first token (None: no rotary)
        block_scores(iq, keys)    -> [B, c, N] each query's score of every block (compute dtype)
        reuses_selection          the layer indexes nothing: it reads the selection the previous decoder layer
                                  handed on (GLM-5.3-Flash's "shared" indexer layers)
        outputs(o, selection)     -> what the module's forward returns, given its output and its selection (the
                                  default: transformers' (output, attention weights None))

    The indexer takes no gradient (its selection is a discrete choice, as in transformers)."""

    pooling = "sum"
    reuses_selection = False

    @property
    def block_size(self) -> int:
        raise NotImplementedError

    @property
    def top_blocks(self) -> int:
        raise NotImplementedError

    def index(self, x_BsD: torch.Tensor, position_embeddings, offsets_Bs: torch.Tensor):
        raise NotImplementedError

    def block_keys(self, sums_BNX: torch.Tensor, cos_BNR: torch.Tensor | None, sin_BNR: torch.Tensor | None):
        raise NotImplementedError

    def block_scores(self, iq, keys) -> torch.Tensor:
        raise NotImplementedError

    def outputs(self, o_BsD: torch.Tensor, selection) -> tuple:
        return o_BsD, None


_MIXER_VIEWS: dict[type, Callable[[nn.Module], LinearMixerView]] = {}
_ATTENTION_VIEWS: dict[type, Callable[[nn.Module], AttentionView]] = {}
_FAMILY_LOADERS: list[Callable[[], object]] = []  # run once, before the first lookup: they register the families


def register_family_loader(load: Callable[[], object]) -> None:
    """`load()` registers views (importing the model adapters); run before the first lookup. deltacp's package
    registers the adapters' import here, so that `import deltacp` stays light and `parallel/` imports no model."""
    _FAMILY_LOADERS.append(load)


def _load_families() -> None:
    while _FAMILY_LOADERS:
        _FAMILY_LOADERS.pop(0)()


def register_mixer_view(module_class: type, factory: Callable[[nn.Module], LinearMixerView]) -> None:
    _MIXER_VIEWS[module_class] = factory


register_gdn_view = register_mixer_view  # the name of earlier versions


def register_attention_view(module_class: type, factory: Callable[[nn.Module], AttentionView]) -> None:
    _ATTENTION_VIEWS[module_class] = factory


def _lookup(registry: dict, module: nn.Module, what: str):
    _load_families()
    for cls in type(module).__mro__:
        if cls in registry:
            return registry[cls](module)
    known = ", ".join(sorted(cls.__name__ for cls in registry))
    raise NotImplementedError(f"{what} applies to transformers' {known}; got {type(module).__name__}")


def mixer_view_of(module: nn.Module) -> LinearMixerView:
    """The registered view of a linear mixer, or NotImplementedError naming its class and the supported ones."""
    if isinstance(module, LinearMixerView):
        return module
    return _lookup(_MIXER_VIEWS, module, "LinearAttentionContextParallel")


gdn_view_of = mixer_view_of  # the name of earlier versions


def attention_view_of(module: nn.Module) -> AttentionView:
    if isinstance(module, AttentionView):
        return module
    return _lookup(_ATTENTION_VIEWS, module, "Ulysses full attention CP")

