"""What a selective activation checkpoint keeps of a decoder layer's forward, so that its recompute in backward
skips the attention kernels (the quadratic part) and takes their outputs instead: exact, since the recompute gets
the very tensors its forward computed.

Two mechanisms, one per kind of call:

- an attention kernel called as an aten op under autograd (SDPA in deltacp's Ulysses attention and at cp = 1,
  one call per row or per document; transformers' own SDPA call): torch's selective activation checkpointing
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) saves its outputs (o, log-sum-exp and the
  kernel's metadata) when the op is one of `ATTENTION_FORWARD_OPS` (`sac_policy`); the autograd node of the
  recomputed op then holds those, and its backward runs as without checkpointing;
- an autograd Function that merges several kernel calls into one output (the tiled and ring attention of
  `parallel/attention_tiles.py`, whose backward reads only the merged o and log-sum-exp): `keep_outputs(name,
  compute)` keeps what `compute()` returns in the forward and returns it again in the recompute without calling
  it. The kernels inside run with saving off (`sac_policy` leaves them to recompute, and the recompute never
  reaches them), so no tile's own output is kept besides the merged one (a ring step's tiles would otherwise
  cost one o each).

`selective_contexts` is the `context_fn` of `torch.utils.checkpoint.checkpoint` that turns both on for one
checkpointed call, with a fresh store per call (a forward without backward leaves nothing behind).

Under the full policy no context is needed: torch's non-reentrant checkpoint stops a recompute once every tensor its
forward saved is saved again (early stop, its default), and an op's inputs are saved before the op runs, so the
recompute of a decoder layer never runs the MLP's down projection, its last product (tests/unit/test_recompute.py).

Collectives inside the region: everything not kept is recomputed as under full checkpointing (the same
collectives, in the same order, on every rank: the Ulysses all-to-alls, the K/V all-gather, the conv halo); a
kept Function skips what `compute` would have issued on every rank alike (the ring's forward exchanges), since
every rank checkpoints the same layers with the same policy. The p2p GDN layers replay their received state as
under full checkpointing (`parallel/p2p.py`).
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

# The forward ops of the attention kernels whose outputs a selective checkpoint keeps, by aten name (an op missing
# from the installed torch is left out). Every attention kernel deltacp or transformers calls under autograd must
# be named here: SDPA's backends on CUDA (cuDNN, flash, memory-efficient), the CPU flash kernel, the varlen flash
# and memory-efficient kernels (`_flash_attention_forward` with cu_seqlens), and the overrideable SDPA entry.
ATTENTION_FORWARD_OP_NAMES = (
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _attention_forward_ops() -> frozenset:
    ops = set()
    for name in ATTENTION_FORWARD_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


ATTENTION_FORWARD_OPS = _attention_forward_ops()

# (store, replaying) of the deltacp checkpoint whose forward or recompute runs now, in this thread (store None:
# the full policy, nothing kept)
_ACTIVE: ContextVar[tuple["KeptOutputs | None", bool] | None] = ContextVar("deltacp_checkpoint_region", default=None)
# True while a kept Function computes: its kernels' outputs are not saved one by one
_INSIDE_KEPT: ContextVar[bool] = ContextVar("deltacp_inside_kept", default=False)


def sac_policy(ctx, func, *args, **kwargs):
    """torch's selective checkpoint policy: keep the outputs of the attention ops, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    if func in ATTENTION_FORWARD_OPS and not _INSIDE_KEPT.get():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class KeptOutputs:
    """The outputs kept by `keep_outputs` in one checkpointed forward, in call order: (name, outputs, versions)."""

    def __init__(self):
        self.entries: list = []
        self.cursor = 0

    def take(self, name: str):
        if self.cursor >= len(self.entries) or self.entries[self.cursor] is None or \
                self.entries[self.cursor][0] != name:
            have = "nothing" if self.cursor >= len(self.entries) else (
                "an entry already used" if self.entries[self.cursor] is None else repr(self.entries[self.cursor][0]))
            raise RuntimeError(f"selective activation checkpointing: the recompute asked for kept call {self.cursor} "
                               f"({name!r}) but the forward kept {have} there: the recompute must run the same "
                               f"kept calls in the same order as its forward (or a second backward through a "
                               f"selectively checkpointed region, which is not supported)")
        _, outputs, versions = self.entries[self.cursor]
        for t, v in zip(_tensors(outputs), versions):
            if t._version != v:
                raise RuntimeError(f"selective activation checkpointing: an output of {name!r} kept in the forward "
                                   f"was modified in place before the recompute; the kept value is no longer "
                                   f"the one the forward computed")
        self.entries[self.cursor] = None  # used once: the recompute's graph holds what it needs
        self.cursor += 1
        return _map_tensors(outputs, torch.Tensor.detach)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _map_tensors(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(item, fn) for item in x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


def keep_outputs(name: str, compute):
    """`compute()` (tensors, tuples, lists, dicts of them and plain values), run in the forward of a selective
    checkpoint and kept; in its recompute the kept outputs come back (detached aliases) and `compute` is not
    called. Outside a selective checkpoint: `compute()`. Call it inside an autograd Function's forward, whose
    backward needs only what `compute` returns (and the Function's inputs)."""
    active = _ACTIVE.get()
    if active is None or active[0] is None:
        return compute()
    store, replaying = active
    if replaying:
        return store.take(name)
    token = _INSIDE_KEPT.set(True)
    try:
        outputs = compute()
    finally:
        _INSIDE_KEPT.reset(token)
    kept = _map_tensors(outputs, torch.Tensor.detach)
    store.entries.append((name, kept, [t._version for t in _tensors(kept)]))
    return outputs


class _Contexts:
    """The state of one checkpointed call's forward or recompute (this store, whether it replays) and, under the
    selective policy, torch's selective checkpoint mode, entered together (again on each recompute)."""

    def __init__(self, sac_mode, store: KeptOutputs | None, replaying: bool):
        self.sac_mode, self.store, self.replaying = sac_mode, store, replaying
        self.tokens: list = []

    def __enter__(self):
        if self.sac_mode is not None:
            self.sac_mode.__enter__()
        self.tokens.append(_ACTIVE.set((self.store, self.replaying)))
        return self

    def __exit__(self, *exc):
        _ACTIVE.reset(self.tokens.pop())
        return None if self.sac_mode is None else self.sac_mode.__exit__(*exc)


def selective_contexts():
    """`context_fn` of `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: (forward context, recompute
    context) of torch's selective checkpoint with `sac_policy`, and the store of `keep_outputs`, fresh per call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    sac_forward, sac_recompute = create_selective_checkpoint_contexts(sac_policy)
    store = KeptOutputs()
    return _Contexts(sac_forward, store, False), _Contexts(sac_recompute, store, True)
