"""Indexed sparse attention on one GPU: deltacp's Triton selected attention (`ops/selected_attention.py`) against transformers' path for the same selection: SDPA with the
dense boolean [T, T] mask its indexer builds (`Qwen4ExpTextAttention` hands that mask to `sdpa_attention_forward`;
its indexer loop over queries in Python is not timed), and dense causal SDPA (flash) as the no-sparsity bound.
Forward and forward + backward (gradients of q, k, v), median of CUDA events after warm-up (bench/timing.py), peak
memory.

Qwen4-Exp's attention shape (16 query heads, 2 KV heads, head dim 256), bf16, one row; the selection: blocks of
`--block` tokens, `--top` of them a query (random scores, the indexer's visibility and tie rule:
`deltacp.testing.selection`). Accuracy at the first length (when at most 16K): rel-L2 of the output and of dq, dk, dv against a float32
dense reference on the same bf16 inputs.

    PYTHONPATH=src python bench/selected_attention.py --lengths 8192 16384 32768 65536 --json out.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, time_cuda  # noqa: E402

H, KV, D = 16, 2, 256


def rel_l2(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def dense_mask(sel, T):
    index, valid = sel.token_index()
    return torch.zeros(1, T, T + 1, dtype=torch.bool, device="cuda").scatter_(
        -1, torch.where(valid, index, T), True)[..., :T]


def sdpa(q, k, v, mask, scale):
    """transformers' sdpa_attention_forward for this layer: [B, heads, T, D], the boolean mask, GQA by SDPA."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=None if mask is None else mask[:, None],
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def main():
    from deltacp.ops.selected_attention import triton_selected_attention
    from deltacp.testing.selection import random_selection

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--top", type=int, default=32)
    ap.add_argument("--sdpa-mask-max", type=int, default=32768, help="longest T for the dense-mask SDPA row")
    ap.add_argument("--json", default=None)
    ap.add_argument("--launch", nargs="*", default=[], metavar="WARPS,STAGES",
                    help="time deltacp's kernels under these launch settings too (at every length)")
    args = ap.parse_args()
    from deltacp.ops import selected_attention_kernels as kernels
    scale = D ** -0.5
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; H={H} KV={KV} D={D} block={args.block} "
          f"top={args.top} (budget {args.block * args.top} tokens)", flush=True)
    for i, T in enumerate(args.lengths):
        sel = random_selection(torch.tensor([0, T]), 1, T, args.block, args.top, T, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(T)
        q, k, v = (torch.randn(1, T, h, D, device="cuda", generator=gen).bfloat16().requires_grad_()
                   for h in (H, KV, KV))
        go = torch.randn(1, T, H * D, device="cuda", generator=gen).bfloat16()
        mask = dense_mask(sel, T) if T <= args.sdpa_mask_max or (i == 0 and T <= 16384) else None
        stacks = {"deltacp triton": lambda: triton_selected_attention(q, k, v, sel, scale),
                  "causal sdpa (dense)": lambda: sdpa(q, k, v, None, scale)}
        if mask is not None:
            stacks["transformers sdpa + mask"] = lambda: sdpa(q, k, v, mask, scale)
        row = {"T": T, "block": args.block, "top": args.top,
               "selected_fraction": float(dense_mask(sel, T).sum() / (T * (T + 1) / 2)) if T <= 32768 else None}
        if i == 0 and T <= 16384:  # the dense fp32 reference holds [heads, T, T] scores
            refs = [x.detach().float().requires_grad_() for x in (q, k, v)]
            qf, kf, vf = (x.transpose(1, 2) for x in refs)
            kf, vf = (x.repeat_interleave(H // KV, dim=1) for x in (kf, vf))
            scores = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
            ref = (scores.softmax(-1) @ vf).transpose(1, 2).reshape(1, T, H * D)
            ref_grads = torch.autograd.grad(ref, refs, go.float())
            del scores
            for name in ("deltacp triton", "transformers sdpa + mask"):
                out = stacks[name]()
                grads = torch.autograd.grad(out, (q, k, v), go)
                row[f"{name} rel_l2"] = {"o": rel_l2(out, ref), **{f"d{n}": rel_l2(a, b)
                                                                      for n, a, b in zip("qkv", grads, ref_grads)}}
            del ref, ref_grads, refs
        for name, fn in stacks.items():
            fwd = time_cuda(lambda: fn(), warmup=3, repeat=10)
            both = time_cuda(lambda: torch.autograd.grad(fn(), (q, k, v), go), warmup=3, repeat=10)
            row[name] = {"fwd_ms": round(fwd["median_ms"], 3), "fwd_bwd_ms": round(both["median_ms"], 3),
                         "peak_gib": round(both["peak_gib"], 2)}
        emit(row, args.json)
        default = dict(kernels.LAUNCH["16-bit"])
        for setting in args.launch:
            warps, stages = map(int, setting.split(","))
            kernels.LAUNCH["16-bit"].update(num_warps=warps, num_stages=stages)
            fn = stacks["deltacp triton"]
            fwd = time_cuda(lambda: fn(), warmup=3, repeat=10)
            both = time_cuda(lambda: torch.autograd.grad(fn(), (q, k, v), go), warmup=3, repeat=10)
            emit({"T": T, "launch": setting, "fwd_ms": round(fwd["median_ms"], 3),
                  "fwd_bwd_ms": round(both["median_ms"], 3)}, args.json)
        kernels.LAUNCH["16-bit"].update(default)
        del mask, stacks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
