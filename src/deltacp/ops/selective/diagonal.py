"""Eager (pure PyTorch) diagonal linear recurrence, one state per channel: the RG-LRU's scan (RecurrentGemma) under
the recurrence contract.

    h_t[h, k] = a_t[h, k] h_{t-1}[h, k] + b_t[h, k]        y_t = h_t

as transformers' `RecurrentGemmaRglru._rnn_scan` computes it token by token (the caller forms the decays a, already 0
where the recurrence resets, and the normalised inputs b: `families/recurrent_gemma.py`). Over a segment h_out = M ⊙
h_in + S with M = prod a elementwise: under the contract (`ops/recurrence.py`) the state is [rows, H, K, 1] (K
channels per head, V = 1) and M is `Transition("diagonal")`, packed [rows, H, K, 1]. The entering state reaches the
output y_t through the running product of the decays (<= 1).

The scan is the selective scan's chunked core (`ops/selective/eager.chunked_scan`: no exponent > 0, about 2 sqrt(T)
Python iterations). Packed documents (one row, `cu_seqlens`): a document start sets that token's decay to 0.

Accumulation in float32 for float32 / bf16 inputs (transformers' `acc_dtype`) and float64 for float64
(`ops.precision.compute_dtype`); the outputs in the inputs' dtype, as transformers stores them; backward by autograd;
the entering state's gradient in closed form.

Shape legend: a_RTHK, b_RTHK [rows, tokens, heads, channels per head].
"""

from __future__ import annotations

import torch

from deltacp.ops.gdn.varlen import as_layout
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs, StagesNothing, Transition
from deltacp.ops.selective.eager import chunked_scan, document_resets

DIAGONAL = Transition("diagonal")


def _decays(a_RTHK: torch.Tensor, b_RTHK: torch.Tensor, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) in the compute dtype, a zeroed at the document starts."""
    cd = compute_dtype(b_RTHK)
    a = a_RTHK.to(cd)
    resets = document_resets(as_layout(cu_seqlens, a.shape[1]), a.shape[1], a.device)
    if resets is not None:
        a = a * (~resets).to(cd)[None, :, None, None]
    return a, b_RTHK.to(cd)


def diagonal_scan(a_RTHK, b_RTHK, *, initial_state=None, output_final_state=False, cu_seqlens=None):
    """(y [rows, T, H, K] in b's dtype, final state [rows, H, K] in the compute dtype, or None); initial_state
    [rows, H, K]. Differentiable in a, b and the entering state."""
    a, b = _decays(a_RTHK, b_RTHK, cu_seqlens)
    h, reach = chunked_scan(a, b)
    if initial_state is not None:
        h = h + reach * initial_state.to(h.dtype)[:, None]
    return h.to(b_RTHK.dtype), (h[:, -1] if output_final_state else None)


class DiagonalScan(StagesNothing):
    """The diagonal recurrence under the contract, eager. Inputs (a, b) [rows, T, H, K]; state [rows, H, K, 1];
    outputs [rows, T, H, K]; M diagonal, packed [rows, H, K, 1]."""

    transition = DIAGONAL
    name = "eager"

    @staticmethod
    def _unpack(x: RecurrenceInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if len(x) != 2:
            raise ValueError(f"the diagonal scan takes two inputs (a, b), got {len(x)}")
        return x.tensors

    def check(self, x: RecurrenceInputs) -> None:
        a, b = self._unpack(x)
        if a.dim() != 4 or a.shape != b.shape:
            raise ValueError(f"the diagonal scan takes a, b [rows, T, heads, channels] of one shape, got "
                             f"{tuple(a.shape)} and {tuple(b.shape)}")
        if not b.is_floating_point():
            raise ValueError(f"the diagonal scan needs floating-point inputs, got {b.dtype}")

    def state_shape(self, x: RecurrenceInputs) -> tuple[int, ...]:
        a, _ = self._unpack(x)
        return (a.shape[0], a.shape[2], a.shape[3], 1)

    def forward(self, x, *, initial_state=None, output_final_state=False, prepared=None, cu_seqlens=None):
        self._no_prepared(prepared)
        a, b = self._unpack(x)
        h0 = None if initial_state is None else initial_state[..., 0]
        y, ht = diagonal_scan(a, b, initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return y, (None if ht is None else ht[..., None])

    def summary(self, x, *, prepared=None, need_transition=True, cu_seqlens=None):
        self._no_prepared(prepared)
        h, reach = chunked_scan(*_decays(*self._unpack(x), cu_seqlens))
        return (DIAGONAL.pack(reach[:, -1], 1) if need_transition else None), h[:, -1, ..., None]

    def initial_state_grad(self, x, grad_o, *, prepared=None, cu_seqlens=None):
        """sum_t reach_t ⊙ grad_o_t, reach_t = prod_{s<=t} a_s."""
        self._no_prepared(prepared)
        a, _ = _decays(*self._unpack(x), cu_seqlens)
        return (torch.cumprod(a, dim=1) * grad_o.to(a.dtype)).sum(dim=1)[..., None]
