"""Launch configurations of the GDN kernels (block widths, warps, pipeline stages), one entry per kernel.

Fixed per kernel rather than autotuned at run time: an autotune key on the sequence length would re-tune for
every new length (a packed stream has a new one every step; the lengths are runtime values of the kernels), and
autotuning would have to restore the buffers that kernels update in place. The values were chosen on one H200 by `bench/gdn_kernels.py --sweep`
(figures and date in NOTES.md); `bench/gdn_kernels.py` rewrites entries of this table to measure others.
"""

from __future__ import annotations

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


def launch_config(name: str, **dims: int) -> tuple[dict[str, int | str], dict[str, int]]:
    """(block sizes, launch options) of kernel `name`, block sizes clipped to the given dims (e.g. K=128)."""
    cfg = dict(LAUNCH[name])
    opts = {o: cfg.pop(o) for o in ("num_warps", "num_stages") if o in cfg}
    blocks = {b: min(size, dims[b[1:]]) if b[1:] in dims else size for b, size in cfg.items()}
    return blocks, opts
