"""Softmax attention of each query over the blocks an indexer selected for it, plus the tail of its own incomplete
block (indexed sparse attention). Knows no ranks: the queries are any subset of a row's positions, the keys and
values the whole row.

A query's keys: the tokens of its chosen blocks (`Selection.blocks`, row block ids, where `ok`), each block
`size` tokens from `block_start`, and its tail, the row positions `tail_lo` .. `pos` (at most size - 1 tokens before
the query, and the query). Both are runs of at most `size` keys from a start, keys after the query excluded
(`Selection.run_starts`).

Two kernels, the same result up to the order of the float additions:
- `gathered_attention`: the selected keys gathered per query ([c, T] scores for a chunk of c queries, T about the
  budget), softmax in the compute dtype. Any device and dtype; the reference and the CPU path.
- `triton_selected_attention` (`selected_attention_kernels.py`): one program per query and KV head reads its runs
  in place (no gathered copies), online softmax; the backward sums each run's dK, dV over its readers in query
  order (no atomics: reproducible). CUDA, bf16 / fp16 / fp32, head dims up to MAX_HEAD_DIM (over 256 in column
  blocks: GLM-5.3-Flash's absorbed MLA, 512-wide queries over its latent as keys and values).
A block-sparse kernel over tiles (FlexAttention's BlockMask) does not fit: the selection is per query, so a tile
of 128 queries reads the union of 128 selections, about every block of the prefix; measured in NOTES.md.

`selected_attention` picks the Triton kernels on CUDA and the gathered kernel elsewhere (no fall-back between them:
a CUDA tensor outside the kernels' contract raises).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltacp.ops.precision import compute_dtype

KV_CHUNK = 64  # queries whose gathered keys and values ([B, c, T, KV heads, D]) the gathered kernel holds at once


@dataclass(frozen=True)
class Selection:
    """What each local query reads. blocks / ok [B, s, kk]: its chosen row blocks (the first `ok`); tail_lo / pos
    [B, s]: its tail's first row position and its own; block_start [B, N]: each row block's first row position;
    size: the block length."""

    blocks: torch.Tensor
    ok: torch.Tensor
    tail_lo: torch.Tensor
    pos: torch.Tensor
    block_start: torch.Tensor
    size: int

    def token_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(index [B, s, T] row positions, valid [B, s, T]) of the tokens each query reads: its runs' tokens
        (T = (kk + 1) * size)."""
        starts = self.run_starts().long()
        B, s, J = starts.shape
        index = (starts[..., None] + torch.arange(self.size, device=starts.device)).view(B, s, J * self.size)
        valid = (starts >= 0).repeat_interleave(self.size, -1) & (index <= self.pos[..., None])
        return index, valid

    def run_starts(self) -> torch.Tensor:
        """[B, s, kk + 1] int32: the first row position of each run of keys a query reads (its chosen blocks, then
        its tail), -1 where none (a block it does not see, an empty tail)."""
        starts = self.block_start.gather(1, self.blocks.reshape(self.blocks.shape[0], -1)).view(self.blocks.shape)
        starts = torch.where(self.ok, starts, -1)
        tail = torch.where(self.tail_lo <= self.pos, self.tail_lo, -1)
        return torch.cat([starts, tail[..., None]], -1).to(torch.int32).contiguous()


def gathered_attention(q_BsHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, index: torch.Tensor,
                       valid: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, s, H * Dv]: each query's softmax attention over the row positions `index` ([B, s, T], where `valid`) of
    the row's keys and values [B, S, KV heads, D] (query head h reads KV head h // (H / KV heads)), in chunks of
    KV_CHUNK queries. Scores and softmax in the compute dtype (float32 for 16-bit inputs)."""
    B, s, H, D = q_BsHD.shape
    KV = k_BSKD.shape[2]
    out = []
    rows_b = torch.arange(B, device=q_BsHD.device)[:, None, None]
    for lo in range(0, s, KV_CHUNK):
        hi = min(s, lo + KV_CHUNK)
        ok = valid[:, lo:hi]
        idx = torch.where(ok, index[:, lo:hi], 0)
        k_sel, v_sel = k_BSKD[rows_b, idx], v_BSKD[rows_b, idx]  # [B, c, T, KV, D]
        q = q_BsHD[:, lo:hi].reshape(B, hi - lo, KV, H // KV, D)
        dt = compute_dtype(q)
        scores = torch.einsum("bckgd,bctkd->bckgt", q.to(dt), k_sel.to(dt)) * scale
        scores = scores.masked_fill(~ok[:, :, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bckgt,bctkd->bckgd", probs, v_sel.to(dt)).to(q_BsHD.dtype)
        out.append(o.reshape(B, hi - lo, -1))  # H x the value head dim
    return torch.cat(out, dim=1)


class _SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos, starts, scale, size):
        from deltacp.ops import selected_attention_kernels as kernels

        o, lse = kernels.forward(q, k, v, pos, starts, scale, size)
        ctx.shared = k is v  # one tensor as the keys and the values (GLM's latent): its gradient in one launch
        ctx.save_for_backward(q, k, None if ctx.shared else v, pos, starts, o, lse)
        ctx.scale, ctx.size = scale, size
        return o

    @staticmethod
    def backward(ctx, do):
        from deltacp.ops import selected_attention_kernels as kernels

        q, k, v, pos, starts, o, lse = ctx.saved_tensors
        v = k if ctx.shared else v
        dq, dk, dv = kernels.backward(q, k, v, pos, starts, o, lse, do.contiguous(), ctx.scale, ctx.size)
        return dq, dk, dv, None, None, None, None


TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 512  # GLM-5.3-Flash's absorbed latent; over 256 in blocks of fewer query heads (kernels' LAUNCH)


def triton_selected_attention(q_BsHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, sel: Selection,
                              scale: float) -> torch.Tensor:
    """[B, s, H * D]: `gathered_attention`'s result by the Triton kernels (module docstring); differentiable in q, k,
    v. q, k, v of one dtype among TRITON_DTYPES, H a multiple of the KV heads."""
    if len({q_BsHD.dtype, k_BSKD.dtype, v_BSKD.dtype}) != 1 or q_BsHD.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton selected attention needs q, k, v of one dtype among {TRITON_DTYPES}; got "
                         f"{q_BsHD.dtype}, {k_BSKD.dtype}, {v_BSKD.dtype}")
    B, s, H, D = q_BsHD.shape
    if H % k_BSKD.shape[2] or k_BSKD.shape[-1] != D or v_BSKD.shape[-1] != D:
        raise ValueError(f"the Triton selected attention needs query heads a multiple of the KV heads and one head "
                         f"dim; got q {tuple(q_BsHD.shape)}, k {tuple(k_BSKD.shape)}, v {tuple(v_BSKD.shape)}")
    if D > MAX_HEAD_DIM:
        raise NotImplementedError(f"the Triton selected attention takes head dims up to {MAX_HEAD_DIM} (the widest "
                                  f"tested: GLM-5.3-Flash's absorbed 512-wide latent); got {D}")
    k = k_BSKD.contiguous()
    v = k if v_BSKD is k_BSKD else v_BSKD.contiguous()  # one tensor stays one (its gradient in one launch)
    o = _SelectedAttention.apply(q_BsHD.contiguous(), k, v, sel.pos.to(torch.int32).contiguous(), sel.run_starts(),
                                 scale, sel.size)
    return o.reshape(B, s, H * D)


def selected_attention(q_BsHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, sel: Selection,
                       scale: float) -> torch.Tensor:
    """[B, s, H * D]: the Triton kernels on CUDA, the gathered kernel elsewhere (module docstring)."""
    if q_BsHD.is_cuda:
        return triton_selected_attention(q_BsHD, k_BSKD, v_BSKD, sel, scale)
    return gathered_attention(q_BsHD, k_BSKD, v_BSKD, *sel.token_index(), scale)
