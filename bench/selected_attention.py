"""Indexed sparse attention on one GPU: deltacp's Triton selected attention (`ops/selected_attention.py`) against transformers' path for the same selection: SDPA with the
dense boolean [T, T] mask its indexer builds (`Qwen4ExpTextAttention` hands that mask to `sdpa_attention_forward`;
its indexer loop over queries in Python is not timed), and dense causal SDPA (flash) as the no-sparsity bound.
Forward and forward + backward (gradients of q, k, v), median of CUDA events after warm-up (bench/timing.py), peak
memory.

Qwen4-Exp's attention shape (16 query heads, 2 KV heads, head dim 256), or with `--shape glm` GLM-5.3-Flash's absorbed
MLA (64 query heads over one 512-wide latent as the keys and the values: blocks of 16 query heads a
program; its pools of 16, top 128: pass --block 16 --top 128), bf16, one row; the selection: blocks of `--block` tokens, `--top` of them a query
(random scores, the indexer's visibility and tie rule: `deltacp.testing.selection`). Accuracy at the first length
(when at most 16K, 4K for glm: the reference holds [heads, T, T] scores): rel-L2 of the output and of dq, dk, dv
against a float32 dense reference on the same bf16 inputs. At glm's shape the SDPA rows run on the same absorbed
tensors (SDPA's GQA over one KV head; transformers' own path expands K / V per head, 256 + 256 wide), and a row
whose SDPA kernel refuses the 512 head dim is recorded with its error.

    PYTHONPATH=src python bench/selected_attention.py --lengths 8192 16384 32768 65536 --json out.jsonl
    PYTHONPATH=src python bench/selected_attention.py --shape glm --block 16 --top 128 --lengths 4096 16384 32768
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, time_cuda  # noqa: E402

SHAPES = {"qwen4-exp": (16, 2, 256, 16384), "glm": (64, 1, 512, 4096)}  # heads, KV heads, head dim, longest reference
H, KV, D = SHAPES["qwen4-exp"][:3]


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
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen4-exp")
    ap.add_argument("--launch", nargs="*", default=[], metavar="WARPS,STAGES[,ROWS]",
                    help="time deltacp's kernels under these launch settings too (at every length; ROWS: the most "
                         "query heads a program takes)")
    args = ap.parse_args()
    from deltacp.ops import selected_attention_kernels as kernels
    global H, KV, D
    H, KV, D, ref_max = SHAPES[args.shape]
    scale = D ** -0.5
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; H={H} KV={KV} D={D} block={args.block} "
          f"top={args.top} (budget {args.block * args.top} tokens)", flush=True)
    for i, T in enumerate(args.lengths):
        sel = random_selection(torch.tensor([0, T]), 1, T, args.block, args.top, T, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(T)
        q, k, v = (torch.randn(1, T, h, D, device="cuda", generator=gen).bfloat16().requires_grad_()
                   for h in (H, KV, KV))
        leaves = (q, k, v)
        if args.shape == "glm":  # one tensor as the keys and the values
            v, leaves = k, (q, k)
        go = torch.randn(1, T, H * D, device="cuda", generator=gen).bfloat16()
        mask = dense_mask(sel, T) if T <= args.sdpa_mask_max or (i == 0 and T <= ref_max) else None
        stacks = {"deltacp triton": lambda: triton_selected_attention(q, k, v, sel, scale),
                  "causal sdpa (dense)": lambda: sdpa(q, k, v, None, scale)}
        if mask is not None:
            stacks["transformers sdpa + mask"] = lambda: sdpa(q, k, v, mask, scale)
        row = {"T": T, "block": args.block, "top": args.top,
               "selected_fraction": float(dense_mask(sel, T).sum() / (T * (T + 1) / 2)) if T <= 32768 else None}
        if i == 0 and T <= ref_max:  # the dense fp32 reference holds [heads, T, T] scores
            refs = [x.detach().float().requires_grad_() for x in leaves]
            qf, kf, vf = (x.transpose(1, 2) for x in (refs if len(refs) == 3 else (*refs, refs[1])))
            kf, vf = (x.repeat_interleave(H // KV, dim=1) for x in (kf, vf))
            scores = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
            ref = (scores.softmax(-1) @ vf).transpose(1, 2).reshape(1, T, H * D)
            ref_grads = torch.autograd.grad(ref, refs, go.float())
            del scores
            names = ("q", "k", "v") if len(leaves) == 3 else ("q", "kv")
            for name in ("deltacp triton", "transformers sdpa + mask"):
                try:
                    out = stacks[name]()
                    grads = torch.autograd.grad(out, leaves, go)
                except RuntimeError as e:  # an SDPA kernel that does not take the head dim
                    row[f"{name} rel_l2"] = f"error: {str(e)[:200]}"
                    continue
                row[f"{name} rel_l2"] = {"o": rel_l2(out, ref), **{f"d{n}": rel_l2(a, b)
                                                                      for n, a, b in zip(names, grads, ref_grads)}}
            del ref, ref_grads, refs
        for name, fn in stacks.items():
            try:
                fwd = time_cuda(lambda: fn(), warmup=3, repeat=10)
                both = time_cuda(lambda: torch.autograd.grad(fn(), leaves, go), warmup=3, repeat=10)
            except RuntimeError as e:  # an SDPA kernel that does not take the head dim (or out of memory)
                row[name] = f"error: {str(e)[:200]}"
                continue
            row[name] = {"fwd_ms": round(fwd["median_ms"], 3), "fwd_bwd_ms": round(both["median_ms"], 3),
                         "peak_gib": round(both["peak_gib"], 2)}
        emit(row, args.json)
        entry = "16-bit wide" if D > kernels.WIDE_DIM else "16-bit"  # the launch entry this shape runs
        default = dict(kernels.LAUNCH[entry])
        for setting in args.launch:
            warps, stages, *rows = map(int, setting.split(","))
            kernels.LAUNCH[entry].update(num_warps=warps, num_stages=stages, **({"rows": rows[0]} if rows else {}))
            fn = stacks["deltacp triton"]
            fwd = time_cuda(lambda: fn(), warmup=3, repeat=10)
            both = time_cuda(lambda: torch.autograd.grad(fn(), leaves, go), warmup=3, repeat=10)
            emit({"T": T, "launch": setting, "fwd_ms": round(fwd["median_ms"], 3),
                  "fwd_bwd_ms": round(both["median_ms"], 3)}, args.json)
        kernels.LAUNCH[entry].update(default)
        del mask, stacks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
