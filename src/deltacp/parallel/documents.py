"""Document structure of a CP step: packed documents, padding, and what each layer kind needs of them.

A packed row (B = 1) holds documents back to back; under CP each rank holds one or two pieces of it (the
sequence layout, `placement.py`), and a document may start and end anywhere relative to the piece boundaries.
Described by the global offsets `cu_seqlens` = [0, ..., S]. From them:

- a linear-recurrent layer in p2p / all_gather mode needs each local piece's offsets, whether its first document continues
  from the previous piece (`DocumentSegment.layout.first_continues`), and each token's document start
  (`doc_start`: the conv reads only taps of the token's own document);
- a linear-recurrent layer in Ulysses mode needs the same for the whole row;
- full attention needs per-document causal masking (`AttentionDocuments`: offsets over the flattened
  [B * S] token stream, so padded batches of B > 1 rows are documents too: valid tokens, then padding).

One `CPForwardContext` is built per model forward by the model pre-hook and handed to every layer; it also
holds what p2p layers record for activation-checkpoint replay, so a recompute finds the states of its own
forward (a forward without backward leaves nothing behind that a later one could pick up).

Shape legend: S global tokens of a row, s local tokens, B rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltacp.ops.gdn.varlen import VarlenLayout, check_cu_seqlens
from deltacp.parallel.attention_tiles import Tile, pack_diagonals, plan_span_tiles


def cu_seqlens_from_position_ids(position_ids_BS: torch.Tensor) -> torch.Tensor | None:
    """Document offsets of a packed row from position ids that restart per document (transformers'
    convention: a document starts wherever the position does not follow on from the previous token).

    Returns None when the row is one document (positions 0, 1, ..., S-1 or any run of consecutive values).
    """
    pos = position_ids_BS.detach().to("cpu", torch.int64)
    if pos.dim() != 2:
        raise ValueError(f"position_ids must be [B, S], got shape {tuple(pos.shape)}")
    starts_BS = torch.ones_like(pos, dtype=torch.bool)
    starts_BS[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    starts_BS[:, 0] = True
    if not bool(starts_BS[:, 1:].any()):
        return None
    if pos.shape[0] != 1:
        raise NotImplementedError(f"packed documents (position_ids restarting inside a row) need one packed row "
                                  f"per batch (B = 1), got B = {pos.shape[0]}; pack every document into one row")
    S = pos.shape[1]
    return torch.cat([starts_BS[0].nonzero().flatten(), torch.tensor([S])])


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, S] positions restarting at 0 at every document start."""
    cu = cu_seqlens.to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    S = int(cu[-1])
    return (torch.arange(S) - torch.repeat_interleave(cu[:-1], lengths))[None]


def cu_seqlens_from_padding(mask_BS: torch.Tensor) -> torch.Tensor | None:
    """Offsets over the flattened [B * S] stream that make full attention of a padded batch per-document
    causal attention: each row's valid tokens form one document, its padding another.

    transformers masks padded keys; a query only ever sees valid keys of its own row at or before it, which is
    causal attention within the row's run of valid tokens, provided that run is contiguous (left or right
    padding). Outputs at padded positions are not defined (they attend to padding only). None: no padding.
    """
    valid = mask_BS.detach().to("cpu").bool()
    if bool(valid.all()):
        return None
    B, S = valid.shape
    bounds = [0]
    for b in range(B):
        row = valid[b]
        idx = row.nonzero().flatten()
        if idx.numel() and int(idx[-1] - idx[0] + 1) != idx.numel():
            raise NotImplementedError(
                f"attention_mask row {b} has padding between valid tokens; under CP a padding mask must be left "
                f"or right padding (each row's valid tokens contiguous). Pack documents with cu_seqlens or "
                f"restarting position_ids instead")
        cuts = [0, S] if idx.numel() == 0 else [0, int(idx[0]), int(idx[-1]) + 1, S]
        bounds += [b * S + c for c in sorted(set(cuts)) if c > 0]
    return torch.tensor(bounds, dtype=torch.int64)


@dataclass
class AttentionDocuments:
    """Per-document causal full attention over the flattened [B * S] stream."""

    cu_seqlens: torch.Tensor  # int64, CPU
    max_len: int
    _cache: dict = field(default_factory=dict, repr=False)  # cu_seqlens per device; tile plans

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor) -> "AttentionDocuments":
        return cls(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))

    def tiles(self, B: int, S: int, spans, block: int | None) -> list[Tile]:
        """`attention_tiles.plan_span_tiles` of these documents for the queries of `spans` (row-position runs in
        local order), each run of consecutive documents' diagonals packed into one tile of at most `block` tokens
        (`pack_diagonals`), planned once per forward (every full attention layer of the step asks for the same
        plan; the context holding this object lives one forward)."""
        spans = tuple((int(lo), int(hi)) for lo, hi in spans)
        key = ("tiles", B, S, spans, block)
        if key not in self._cache:
            self._cache[key] = pack_diagonals(plan_span_tiles(B, S, spans, self.cu_seqlens, block), block)
        return self._cache[key]

    def starts(self, B: int, S: int, spans) -> torch.Tensor:
        """[B, L] int64 (CPU): the row position of the document start of every query of `spans` (row-position runs
        in local order, L tokens in all), for windows that stop at document starts (`sliding_attention.py`);
        documents never cross rows (a padded batch's padding is a document of its row). Cached per forward."""
        spans = tuple((int(lo), int(hi)) for lo, hi in spans)
        key = ("starts", B, S, spans)
        if key not in self._cache:
            cu = self.cu_seqlens
            if int(cu[-1]) != B * S:
                raise ValueError(f"attention documents cover {int(cu[-1])} tokens, expected the flattened batch "
                                 f"B * S = {B} * {S}")
            pos = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
            flat = torch.arange(B)[:, None] * S + pos[None]
            self._cache[key] = cu[torch.searchsorted(cu, flat, right=True) - 1] - torch.arange(B)[:, None] * S
        return self._cache[key]

    def on(self, device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._cache:
            self._cache[device] = self.cu_seqlens.to(device=device, dtype=torch.int32)
        return self._cache[device]


@dataclass
class DocumentSegment:
    """The documents of tokens [lo, hi) of a packed row, as one linear-recurrent layer on one rank sees them."""

    layout: VarlenLayout  # local offsets; first_continues: the first document began before lo
    doc_start: torch.Tensor  # [s] int32: local index of each token's document start (negative: began before lo)
    _device: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, lo: int, hi: int) -> "DocumentSegment":
        cu = cu_seqlens
        inner = cu[(cu > lo) & (cu < hi)]
        local = torch.cat([torch.tensor([0]), inner - lo, torch.tensor([hi - lo])])
        continues = not bool((cu == lo).any())
        layout = VarlenLayout.of_checked(local, first_continues=continues)  # derived from checked offsets
        t = torch.arange(hi - lo)
        doc = torch.searchsorted(cu, t + lo, right=True) - 1
        start = cu[doc] - lo
        return cls(layout, start.to(torch.int32))

    def doc_starts(self, device) -> torch.Tensor:
        """`doc_start` on `device` (the conv's per-document taps), moved once per device."""
        device = torch.device(device)
        if device not in self._device:
            self._device[device] = self.doc_start.to(device)
        return self._device[device]


@dataclass
class PackedDocuments:
    """The global document offsets of one packed row under CP, and the per-layer views built from them."""

    cu_seqlens: torch.Tensor  # int64, CPU, [N + 1], last = S
    _segments: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, seq_len: int, name: str = "cu_seqlens") -> "PackedDocuments":
        return cls(check_cu_seqlens(cu_seqlens, seq_len, name))

    @property
    def seq_len(self) -> int:
        return int(self.cu_seqlens[-1])

    def segment(self, lo: int, hi: int) -> DocumentSegment:
        key = (lo, hi)
        if key not in self._segments:
            self._segments[key] = DocumentSegment.build(self.cu_seqlens, lo, hi)
        return self._segments[key]


@dataclass
class CPForwardContext:
    """Everything a CP'd layer needs of one model forward beyond its hidden states (see module docstring).

    padding: the local 2-D padding mask [B, s] (linear-recurrent layers zero padded tokens), or None.
    documents: the packed row's documents (B = 1), or None.
    attention: per-document causal attention over the flattened batch (documents or padding), or None
        (plain causal).
    replay: per p2p layer, what its forward received (H_in and M), for an activation-checkpoint recompute.
    """

    padding: torch.Tensor | None = None
    documents: PackedDocuments | None = None
    attention: AttentionDocuments | None = None
    replay: dict = field(default_factory=dict, repr=False)

    def bool(self) -> torch.Tensor:
        """The local padding mask as bool ([B, s]; a 0-dim True without padding): a text model that reads its
        linear layers' mask as a tensor (`torch.where(conv_mask.bool(), ids, eos)`: padded tokens' n-gram ids, per
        token) gets this rank's mask."""
        return torch.tensor(True) if self.padding is None else self.padding.bool()


PACKING_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def documents_from_keywords(seq_len: int, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                            max_length_k=None) -> PackedDocuments | None:
    """transformers' packing keywords (as DataCollatorWithFlattening makes them) -> the row's documents.

    Under CP the offsets are GLOBAL: over the whole packed row of `seq_len` tokens, not the rank's slice.
    Self-attention only: cu_seq_lens_k must equal cu_seq_lens_q, and max_length_q/k (if given) must be the
    longest document's length.
    """
    given = {k: v for k, v in zip(PACKING_KEYWORDS, (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k))
             if v is not None}
    if not given:
        return None
    if cu_seq_lens_q is None:
        raise ValueError(f"{sorted(given)} given without cu_seq_lens_q: packed documents are described by "
                         f"cu_seq_lens_q (global document offsets [0, ..., {seq_len}])")
    docs = PackedDocuments.build(cu_seq_lens_q, seq_len, "cu_seq_lens_q (global offsets under CP)")
    one = docs.cu_seqlens.numel() == 2  # one document: an unpacked row (checked below all the same)
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k.detach().to("cpu", torch.int64),
                                                     docs.cu_seqlens):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (causal self-attention over the same documents)")
    longest = int((docs.cu_seqlens[1:] - docs.cu_seqlens[:-1]).max())
    for name, value in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
        if value is not None and int(value) != longest:
            raise ValueError(f"{name}={int(value)} does not match the longest document of cu_seq_lens_q "
                             f"({longest})")
    return None if one else docs


def refuse_unsupported(what: str, keywords: dict) -> None:
    """A CP'd forward honours every keyword it takes or raises, naming the rest (never drops one silently)."""
    unsupported = sorted(k for k, v in keywords.items() if v is not None and v is not False)
    if unsupported:
        raise NotImplementedError(f"{what} under context parallelism does not support the keyword(s) "
                                  f"{unsupported}; remove them (inference caches are out of scope: "
                                  f"use_cache=False)")


def fingerprints(values: dict, ok: bool = True) -> dict[str, tuple[int, ...]]:
    """Per integer tensor (or int, or None) of `values` (packing keywords, token ids, image grids): (given, count,
    sum, sum of squares, index-weighted sum), computed where the tensor lives (int64, exact modulo 2^64): equal on
    ranks that received the same values (what `raise_together` compares). ok=False (a local check failed: the
    values may have no data): zeros of the same length, so that the exchanged header keeps its length on every rank
    (the failing rank raises its own error first)."""
    out = {}
    for name, value in values.items():
        if value is None or not ok:
            out[name] = (0, 0, 0, 0, 0)
            continue
        x = value.detach().flatten().to(torch.int64) if isinstance(value, torch.Tensor) else torch.tensor(
            [int(value)])
        index = torch.arange(1, x.numel() + 1, device=x.device)
        out[name] = (1, x.numel(), *torch.stack([x.sum(), (x * x).sum(), (x * index).sum()]).tolist())
    return out
