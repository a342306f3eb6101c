"""Bytes moved and memory per rank of one indexed attention layer (Qwen4-Exp's QSA, GLM-5.3-Flash's MLA with its
pooled indexer) under CP, by formula: the K/V all-gather deltacp runs (parallel/indexed_attention.py), a ring, and
fetching only the selected blocks.

    python bench/indexed_attention_traffic.py            # the NOTES.md table (markdown)
    python bench/indexed_attention_traffic.py --glm5-next   # GLM-5.3-Flash: expanded K/V against the MLA latent

GLM-5.3-Flash (transformers 5.25's Glm5NextTextConfig defaults): 64 heads, K = V = 256 per head after kv_b_proj, so
the expanded K + V are 64 KiB per token in bf16, against the 512-wide latent (kv_lora_rank, bf16: 1 KiB per token)
from which every rank can rebuild them (kv_a_layernorm and kv_b_proj are per token); pools of 16, top 2048 tokens,
index head dim 128; the softmax pooling all-reduces each pool's maximum logits (128 fp32) and its sums (2 x 128
fp32); NoPE, no angles.

Sizes, B = 1, bf16 K/V: Qwen4-Exp's defaults (transformers 5.25's Qwen4ExpTextConfig) of 2 KV heads of head_dim 256,
so K + V are 2 * 2 * 256 * 2 B = 2 KiB per token. The QSA fields have no default (None): the assumed values are
indexer_budget 2048, indexer_compress_ratio 16, indexer_head_dim 128 (flags below); the pooled exchange moves per
block the fp32 key sums (d) and the fp32 cos / sin at the block start (2 x R rotary dims, R = head_dim x
partial_rotary_factor: 64 assumed, 256 x 0.25 as in Qwen3.5's checkpoints).

Per rank r of P, local s = S / P tokens, per layer and per forward (backward: the all-gather's reduce-scatter moves
the same K/V bytes again; the pooled sums take no gradient):
- all_gather: receives (P - 1) s K/V tokens; holds the whole row's K/V, S tokens (kept for backward);
- ring: receives the same (P - 1) s tokens in P - 1 steps; holds 2 blocks of s tokens (this and the next), plus the
  running output and log-sum-exp, but every rank must visit every earlier block, selected or not;
- selected only: receives the distinct earlier tokens its queries selected. Upper bound: the whole prefix of earlier
  ranks, min(r s, s * budget) tokens (with s * budget >> S at these sizes the bound is the prefix, the last rank's
  (P - 1) s, the all-gather's bytes); lower bound: budget tokens (every query chose the same blocks). Data-dependent:
  a request all-to-all-v of block ids first, then a ragged reply;
- pooled block sums (all three): an all-reduce of N = S / ratio blocks of (d + 2 R) fp32 values, a ring all-reduce
  moving 2 (P - 1) / P of it per rank, N (d + 2 R) x 4 B held on every rank;
- the block scores of one chunk of c = 1024 queries: c N fp32 (parallel/indexed_attention.QUERY_CHUNK).
"""

from __future__ import annotations

import argparse

GIB = 1024 ** 3


def figures(S: int, P: int, kv_bytes: int, budget: int, ratio: int, d: int, rotary: int, chunk: int = 1024) -> dict:
    s = S // P
    N = S // ratio
    pooled = N * (d + 2 * rotary) * 4
    return dict(
        all_gather_moved=(P - 1) * s * kv_bytes, all_gather_held=S * kv_bytes,
        ring_moved=(P - 1) * s * kv_bytes, ring_held=2 * s * kv_bytes,
        selected_moved_max=min((P - 1) * s, s * budget) * kv_bytes,
        selected_moved_min=min(budget, (P - 1) * s) * kv_bytes,
        selected_held_max=S * kv_bytes,
        pooled_moved=2 * (P - 1) * pooled // P, pooled_held=pooled, scores_chunk=chunk * N * 4)


def glm5_next_table(S_values=(128 * 1024, 1024 * 1024), P_values=(8, 16, 32)) -> None:
    heads, kv_dim, latent, ratio, d = 64, 256, 512, 16, 128
    expanded, compressed = 2 * heads * kv_dim * 2, latent * 2
    print("| tokens | CP | expanded K/V all-gather: moved / held | latent all-gather: moved / held | pooled max + sums: "
          "moved / held | scores of 1024 queries |")
    print("|---|---|---|---|---|---|")
    for S in S_values:
        for P in P_values:
            s, N = S // P, S // ratio
            pooled = N * 3 * d * 4
            print(f"| {S // 1024}K | {P} | {(P - 1) * s * expanded / GIB:.1f} / {S * expanded / GIB:.1f} GiB | "
                  f"{(P - 1) * s * compressed / GIB:.2f} / {S * compressed / GIB:.2f} GiB | "
                  f"{2 * (P - 1) * pooled / P / 2**20:.1f} / {pooled / 2**20:.1f} MiB | {1024 * N * 4 / 2**20:.0f} MiB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--ratio", type=int, default=16)
    ap.add_argument("--index-dim", type=int, default=128)
    ap.add_argument("--rotary", type=int, default=64)
    ap.add_argument("--glm5-next", action="store_true", help="GLM-5.3-Flash's table (the flags above unused)")
    args = ap.parse_args()
    if args.glm5_next:
        return glm5_next_table()
    kv = 2 * args.kv_heads * args.head_dim * 2
    print("| tokens | CP | all-gather: moved / held | ring: moved / held | selected only: moved (max .. min) | "
          "pooled sums: moved / held | scores of 1024 queries |")
    print("|---|---|---|---|---|---|---|")
    for S in (128 * 1024, 1024 * 1024):
        for P in (8, 16, 32):
            f = figures(S, P, kv, args.budget, args.ratio, args.index_dim, args.rotary)
            g = {k: v / GIB for k, v in f.items()}
            print(f"| {S // 1024}K | {P} | {g['all_gather_moved']:.2f} / {g['all_gather_held']:.2f} GiB | "
                  f"{g['ring_moved']:.2f} / {g['ring_held']:.3f} GiB | {g['selected_moved_max']:.2f} GiB .. "
                  f"{g['selected_moved_min'] * 1024:.0f} MiB | {g['pooled_moved'] * 1024:.1f} / "
                  f"{g['pooled_held'] * 1024:.1f} MiB | {g['scores_chunk'] * 1024:.0f} MiB |")


if __name__ == "__main__":
    main()
