"""Launch configurations of the GDN kernels (block widths, warps, pipeline stages), one entry per kernel.

Fixed per kernel rather than autotuned at run time: an autotune key on the sequence length would re-tune for
every new length (a packed stream has a new one every step; the lengths are runtime values of the kernels), and
autotuning would have to restore the buffers that kernels update in place. The values were chosen on one H200 by `bench/gdn_kernels.py --sweep`
(figures and date in NOTES.md); `bench/gdn_kernels.py` rewrites entries of this table to measure others.
"""

from __future__ import annotations


def padded(n: int) -> int:
    """The width of a tile spanning a head dim of n: the next power of two >= n (tl.arange's sizes), its columns >= n
    masked in the kernels (indexing.py)."""
    return 1 << (n - 1).bit_length()

LAUNCH: dict[str, dict[str, int | str]] = {
    "kkt_inv_diag": dict(num_warps=1),
    # the merge's 16x16 products on tensor cores, 3 tf32 terms (T within 8e-9 of the fp32-FMA merge), faster than
    # fp32 FMAs (NOTES.md)
    "tril_merge": dict(MERGE_PREC="tf32x3", num_warps=1),
    # SPLIT (wu_fwd, wy_bwd): bf16 products with hi/lo splits instead of tf32 (wy.py says which), faster and closer to
    # fp64 (NOTES.md)
    "wu_fwd": dict(BK=64, BV=64, SPLIT=1, num_warps=4, num_stages=3),
    # the summary's W (fp32, tf32x3 products): the block shape its accuracy was validated with (not swept)
    "summary_wu_fwd": dict(BK=64, BV=64, num_warps=4, num_stages=3),
    # wy_bwd, dqkwg: only configurations that are bitwise reproducible and (wy_bwd) match the fp64 WY backward;
    # on the H200 with Triton 3.6 several others race or miscompile (NOTES.md, launch configurations)
    "wy_bwd": dict(BK=64, BV=64, SPLIT=1, num_warps=4, num_stages=2),
    "state_fwd": dict(BV=32, num_warps=4, num_stages=3),
    "state_bwd": dict(BV=32, num_warps=4, num_stages=3),
    # the summary's transition M: fp32 operands (tf32x3 products), state width K, values 0; one pipeline stage
    # (faster than two, same bits: NOTES.md)
    "summary_state_fwd": dict(BV=32, num_warps=4, num_stages=1),
    "o_fwd": dict(BV=128, num_warps=4, num_stages=3),
    "dv_local": dict(BV=128, num_warps=4, num_stages=2),
    "dqkwg": dict(BK=128, BV=64, num_warps=8, num_stages=3),
}

# Where a tile spans a head dim K of 192 or 256 (padded to 256 columns): entries replacing LAUNCH's, because those
# need more shared memory than a Hopper SM has (228 KiB): state_bwd 325 KiB at three stages (as compiled for sm_90,
# Triton 3.6 and 3.9).
LAUNCH_WIDE_K: dict[str, dict[str, int | str]] = {
    "state_bwd": dict(BV=32, num_warps=4, num_stages=2),
}


def launch_config(name: str, **dims: int) -> tuple[dict[str, int | str], dict[str, int]]:
    """(block sizes, launch options) of kernel `name`, block sizes clipped to the next power of two of the given
    dims (K=64: BK 128 -> 64; V=96: BV 128 -> 128, its last 32 columns masked; indexing.py); LAUNCH_WIDE_K's entry
    where K is given and wider than 128."""
    cfg = dict(LAUNCH_WIDE_K[name] if name in LAUNCH_WIDE_K and padded(dims.get("K", 1)) > 128 else LAUNCH[name])
    opts = {o: cfg.pop(o) for o in ("num_warps", "num_stages") if o in cfg}
    blocks = {b: min(size, padded(dims[b[1:]])) if b[1:] in dims else size for b, size in cfg.items()}
    return blocks, opts
