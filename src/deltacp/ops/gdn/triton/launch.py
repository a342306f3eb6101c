"""Launch configurations of the GDN kernels (block widths, warps, pipeline stages), one entry per kernel.

Fixed per kernel rather than autotuned at run time: an autotune key on the sequence length would re-tune for
every new length (a packed stream has a new one every step; the lengths are runtime values of the kernels), and
autotuning would have to restore the buffers that kernels update in place. The values were chosen on one H200 by `bench/gdn_kernels.py --sweep`
(figures and date in NOTES.md); `bench/gdn_kernels.py` rewrites entries of this table to measure others.
"""

from __future__ import annotations

import functools

import torch


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
    # the state kernels: FILL_BV, the narrowest BV the one-wave rule (fill_bv) may halve BV to
    "state_fwd": dict(BV=32, FILL_BV=16, num_warps=4, num_stages=3),
    "state_bwd": dict(BV=32, FILL_BV=16, num_warps=4, num_stages=3),
    # the summary's transition M: fp32 operands (tf32x3 products), state width K, values 0; one pipeline stage
    # (faster than two, same bits: NOTES.md); the one-wave rule as the state kernels (16 heads at 32K on an H100:
    # 2.46 -> 2.02 ms, the same bits)
    "summary_state_fwd": dict(BV=32, FILL_BV=16, num_warps=4, num_stages=1),
    "o_fwd": dict(BV=128, num_warps=4, num_stages=3),
    "dv_local": dict(BV=128, num_warps=4, num_stages=2),
    "dqkwg": dict(BK=128, BV=64, num_warps=8, num_stages=3),
}

# Where a tile spans a head dim K of 192 or 256 (padded to 256 columns): entries replacing LAUNCH's, because those
# need more shared memory than a Hopper SM has (228 KiB): state_bwd 325 KiB at three stages (as compiled for sm_90,
# Triton 3.6 and 3.9).
LAUNCH_WIDE_K: dict[str, dict[str, int | str]] = {
    "state_bwd": dict(BV=32, FILL_BV=16, num_warps=4, num_stages=2),
}


def fill_bv(bv: int, least: int, programs: int, V: int, sms: int) -> int:
    """The value block of a kernel whose programs each walk the whole sequence (the state kernels: one program per
    value block, head and row), given `programs` programs per value block on a device of `sms` SMs: BV halves, down
    to `least`, while twice the grid still fits in one wave. Fewer programs than SMs leave SMs idle for the whole
    sequential walk; more than one wave of narrower programs repeats the K-side loads once more each. Measured at
    32K on an H100 (NOTES.md): 32 heads x 4 blocks of 32 (128 programs) beat 8 blocks of 16 (0.70 vs 0.94 ms,
    state_fwd); 16 heads x 8 blocks of 16 beat 4 of 32 (0.49 vs 0.62), 8 heads likewise (0.47 vs 0.59)."""
    while bv > least and 2 * programs * -(-V // bv) <= sms:
        bv //= 2
    return bv


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int | None:
    """The SMs of a CUDA device; None elsewhere (the CPU interpreter: no wave to fill)."""
    return _sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None


def launch_config(name: str, *, programs: int | None = None, sms: int | None = None,
                  **dims: int) -> tuple[dict[str, int | str], dict[str, int]]:
    """(block sizes, launch options) of kernel `name`, block sizes clipped to the next power of two of the given
    dims (K=64: BK 128 -> 64; V=96: BV 128 -> 128, its last 32 columns masked; indexing.py); LAUNCH_WIDE_K's entry
    where K is given and wider than 128. An entry with FILL_BV (the state kernels) takes `programs` (the grid's
    programs per value block) and `sms` (the device's SMs, None on the interpreter) and narrows BV by fill_bv."""
    cfg = dict(LAUNCH_WIDE_K[name] if name in LAUNCH_WIDE_K and padded(dims.get("K", 1)) > 128 else LAUNCH[name])
    opts = {o: cfg.pop(o) for o in ("num_warps", "num_stages") if o in cfg}
    least = cfg.pop("FILL_BV", None)
    blocks = {b: min(size, padded(dims[b[1:]])) if b[1:] in dims else size for b, size in cfg.items()}
    if least is not None:
        if programs is None or "V" not in dims:
            raise ValueError(f"launch_config({name!r}): its FILL_BV needs programs= and V=")
        if sms is not None:
            blocks["BV"] = fill_bv(blocks["BV"], min(least, blocks["BV"]), programs, dims["V"], sms)
    return blocks, opts
