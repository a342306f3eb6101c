"""Packed documents in one row (B = 1): the chunks every GDN backend runs them in.

A packed row holds documents back to back, described by `cu_seqlens` = [0, end_0, end_1, ..., T] (int, strictly
increasing: every document has at least one token). The gated delta rule restarts its state at each document
start. Backends run such a row in chunks that never straddle two documents: each document is cut into chunks of
C = 64 tokens from its start, its last chunk partial. In the chunk-aligned layout (`to_chunks`: each document from
a multiple of C, its tail zero-padded to the next; a zero token has k = v = q = 0, beta = 0, g = 0 and leaves the
state unchanged) the intra-chunk work is the dense op's, unchanged. The eager backend copies the row into that
layout; the Triton kernels read and write the packed row in place through `chunk_table` (each chunk's first token
and token count), masking a partial chunk's tail to the same zeros. Only the chunk-to-chunk recurrence needs to
know where documents start: `chunk_resets` marks the chunks whose entering state is zero.

The entering state of the row (`initial_state` of the op) feeds the first document only, and only when it
continues a document from before the row (`first_continues`: under CP, a document that began on an earlier
rank). Otherwise chunk 0 resets too, and the entering state has no effect (its gradient is zero). The final
state is the last document's.

Shape legend: x_1TX a packed row [1, T, ...]; x_1PX its chunk-aligned layout [1, Tp, ...], Tp = padded length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltacp.ops.gdn.contract import CHUNK_SIZE


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> torch.Tensor:
    """Validate document offsets of a row of `total` tokens; return them as int64 on the CPU."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor of document offsets [0, ..., {total}], got "
                         f"{cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else tuple(cu_seqlens.shape)}"
                         f"{'' if not isinstance(cu_seqlens, torch.Tensor) else ' ' + str(cu_seqlens.dtype)}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.numel() < 2 or cu[0].item() != 0 or cu[-1].item() != total:
        raise ValueError(f"{name} must start at 0 and end at the row length {total}, got {cu.tolist()[:8]}"
                         f"{'...' if cu.numel() > 8 else ''} (length {cu.numel()}, last {cu[-1].item()})")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"{name} must be strictly increasing (every document has at least one token); got "
                         f"{cu.tolist()[:16]}{'...' if cu.numel() > 16 else ''}")
    return cu


@dataclass
class VarlenLayout:
    """Where each token of a packed row sits in the chunk-aligned layout, and where the state resets.

    Built once per row (and per step under CP) on the host; the copy plans and per-device reset flags are cached.
    """

    cu_seqlens: torch.Tensor  # int64, CPU, [N + 1]
    first_continues: bool = True  # the entering state feeds the first document
    padded: int = 0  # Tp, a multiple of CHUNK_SIZE
    chunk_resets: list[bool] = field(default_factory=list)  # per chunk of the layout: entering state is zero
    _index: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, total: int, first_continues: bool = True) -> "VarlenLayout":
        """The layout of offsets given from outside (validated here)."""
        return cls.of_checked(check_cu_seqlens(cu_seqlens, total), first_continues)

    @classmethod
    def of_checked(cls, cu: torch.Tensor, first_continues: bool = True) -> "VarlenLayout":
        """The layout of offsets derived from validated ones (int64, CPU; e.g. one rank's segment of a row whose
        offsets were checked once): not validated again."""
        lengths = (cu[1:] - cu[:-1]).tolist()
        chunks = [-(-n // CHUNK_SIZE) for n in lengths]
        resets = []
        for d, n in enumerate(chunks):
            resets += [d > 0 or not first_continues] + [False] * (n - 1)
        return cls(cu, first_continues, CHUNK_SIZE * sum(chunks), resets)

    @property
    def total(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_documents(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def any_reset(self) -> bool:
        """Whether the final state depends on anything but the entering state's path (M = 0 if so)."""
        return any(self.chunk_resets)

    def doc_table(self, device: torch.device) -> torch.Tensor:
        """[N + 1, 2] int32 (for kernels): per document its first token in the packed row and its first chunk of
        the layout; row N holds the totals (T, Tp / C)."""
        key = ("docs", torch.device(device))
        if key not in self._index:
            cu = self.cu_seqlens.tolist()
            first_chunk = [0]
            for a, b in zip(cu[:-1], cu[1:]):
                first_chunk.append(first_chunk[-1] + -(-(b - a) // CHUNK_SIZE))
            self._index[key] = torch.tensor(list(zip(cu, first_chunk)), dtype=torch.int32).to(device)
        return self._index[key]

    def chunk_table(self, device: torch.device) -> torch.Tensor:
        """[Tp / C, 2] int32 (for kernels): per chunk of the layout, its first token in the packed row and its
        token count (C, or less for a document's last chunk)."""
        key = ("chunks", torch.device(device))
        if key not in self._index:
            rows = []
            for a, b in zip(self.cu_seqlens[:-1].tolist(), self.cu_seqlens[1:].tolist()):
                rows += [(t, min(CHUNK_SIZE, b - t)) for t in range(a, b, CHUNK_SIZE)]
            self._index[key] = torch.tensor(rows, dtype=torch.int32).to(device)
        return self._index[key]

    def plans(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Copy plans of the two re-layouts as (source start or -1 for zeros, length) runs along tokens."""
        if "plans" not in self._index:
            cu = self.cu_seqlens.tolist()
            to, back, at = [], [], 0
            for a, b in zip(cu[:-1], cu[1:]):
                n, pad = b - a, (-(b - a)) % CHUNK_SIZE
                to += [(a, n)] + ([(-1, pad)] if pad else [])
                back.append((at, n))
                at += n + pad
            self._index["plans"] = (to, back)
        return self._index["plans"]

    def to_chunks(self, x_1TX: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [1, Tp, ...], documents chunk-aligned, zeros between them (differentiable; one
        concatenation of contiguous runs each way, backward = `from_chunks` of the gradient)."""
        if x_1TX.shape[0] != 1 or x_1TX.shape[1] != self.total:
            raise ValueError(f"packed documents need one row of {self.total} tokens (B = 1), got a tensor of "
                             f"shape {tuple(x_1TX.shape)}")
        return _Relayout.apply(x_1TX, self, True)

    def from_chunks(self, y_1PX: torch.Tensor) -> torch.Tensor:
        """[1, Tp, ...] -> [1, T, ...] (differentiable; backward = `to_chunks` of the gradient)."""
        if y_1PX.shape[0] != 1 or y_1PX.shape[1] != self.padded:
            raise ValueError(f"expected the chunk-aligned layout [1, {self.padded}, ...], got {tuple(y_1PX.shape)}")
        return _Relayout.apply(y_1PX, self, False)


def _copy_runs(x: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenate runs of x's tokens (dim 1) and zero runs: one copy kernel instead of a fill and a scatter."""
    longest_zero = max((n for start, n in runs if start < 0), default=0)
    zeros = x.new_zeros((x.shape[0], longest_zero, *x.shape[2:])) if longest_zero else None
    return torch.cat([x.narrow(1, start, n) if start >= 0 else zeros.narrow(1, 0, n) for start, n in runs], dim=1)


class _Relayout(torch.autograd.Function):
    """to_chunks (forward=True) or from_chunks; the backward of each is the other, applied to the gradient."""

    @staticmethod
    def forward(ctx, x, layout: VarlenLayout, forward: bool):
        ctx.layout, ctx.forward_dir = layout, forward
        to, back = layout.plans()
        return _copy_runs(x.contiguous(), to if forward else back)

    @staticmethod
    def backward(ctx, grad):
        to, back = ctx.layout.plans()
        return _copy_runs(grad.contiguous(), back if ctx.forward_dir else to), None, None


def as_layout(cu_seqlens: "torch.Tensor | VarlenLayout | None", total: int) -> VarlenLayout | None:
    """A backend's `cu_seqlens` argument as a layout: None (one sequence per row), offsets, or a built layout."""
    if cu_seqlens is None or isinstance(cu_seqlens, VarlenLayout):
        if cu_seqlens is not None and cu_seqlens.total != total:
            raise ValueError(f"the varlen layout covers {cu_seqlens.total} tokens, the inputs {total}")
        return cu_seqlens
    return VarlenLayout.build(cu_seqlens, total)
