"""The fused causal conv + SiLU + q/k/v split (`deltacp.ops.fused.conv`) on CUDA at the production shape: Qwen3.5's
GDN conv, C = 2*16*128 + 32*128 = 8192 channels, kernel 4, no bias, bf16, B = 1.

- vs the eager path in fp32 on the same bf16 values (`ops.gdn.eager.causal_conv_silu`, inputs upcast): outputs and
  the gradients of x, weight and the left context within rel-L2 TOL (bf16 rounding of the outputs: ~4e-3); the
  eager bf16 path's own error is printed beside. Unpacked (Ulysses-like: no left context) and packed (a middle
  rank's slice of a packed row: left context, log-normal documents with length-1 ones, the first document begun
  on an earlier rank); x is a strided slice of a wider projection output, as Ulysses hands it over.
- backward deterministic: a second run gives the same bits (dw, dx).
- no new compiled variant across lengths (packed streams change length every step).
- timing print: forward, backward, forward + backward vs today's eager path (conv + fix + SiLU + split + the
  q/k/v .contiguous() that p2p does), and the HBM bandwidth the fused kernels reach.
"""

from __future__ import annotations

import pytest
import torch

from deltacp.testing.documents import cu_of, doc_lengths
from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the fused Triton conv); its CPU interpreter test is "
                                       "tests/unit/test_fused_conv.py")

SPLIT = (2048, 2048, 4096)  # q, k = 16 heads x 128; v = 32 heads x 128
C, KW = sum(SPLIT), 4
TOL = 1e-2


def make(s: int, packed: bool, seed: int = 0):
    """x [1, s, C] bf16 (a slice of a wider projection output), weight [C, 4] bf16, left [1, 3, C] or None, doc
    starts [s] int32 or None, output gradients."""
    from deltacp.parallel.documents import DocumentSegment

    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *sh: torch.randn(*sh, device="cuda", generator=gen)  # noqa: E731
    wide = r(1, s, C + 2 * 32).bfloat16()
    x = wide[..., :C]
    w = (r(C, KW) * 0.5).bfloat16()
    left = r(1, KW - 1, C).bfloat16() if packed else None
    starts = None
    if packed:  # tokens [s, 2s) of a packed row of 3s tokens: a middle rank's slice
        cu = cu_of(doc_lengths(3 * s, median=s / 16, sigma=1.0, seed=seed))
        starts = DocumentSegment.build(cu, s, 2 * s).doc_starts("cuda")
    dys = [r(1, s, n).bfloat16() for n in SPLIT]
    return x, w, left, starts, dys


def fused(x, w, left, starts, dys):
    from deltacp.ops.fused.conv import conv_silu_split

    leaves = [t if t is None else t.detach().requires_grad_() for t in (x, w, left)]
    outs = conv_silu_split(leaves[0], leaves[1], None, 1, left_BhC=leaves[2], doc_start_s=starts, split=SPLIT)
    used = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(outs, used, dys)
    return torch.cat(outs, -1), list(grads)


def eager(x, w, left, starts, dys, dtype):
    from deltacp.ops.gdn.eager import causal_conv_silu

    leaves = [t if t is None else t.detach().to(dtype).requires_grad_() for t in (x, w, left)]
    y = causal_conv_silu(leaves[0], leaves[1], None, 1, leaves[2], starts)
    used = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(y, used, torch.cat(dys, -1).to(dtype))
    return y, list(grads)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("s", [16384, 65536])
def test_bf16_vs_fp32_eager(s, packed):
    x, w, left, starts, dys = make(s, packed, seed=s % 97 + packed)
    if packed:
        assert int(starts[0]) < 0 and int((starts == torch.arange(s, device="cuda")).sum()) >= 2, \
            "the slice's first document must begin before it, and documents (some of length 1) start inside it"
    y, gr = fused(x, w, left, starts, dys)
    ry, rg = eager(x, w, left, starts, dys, torch.float32)
    by, bg = eager(x, w, left, starts, dys, torch.bfloat16)
    names = ["y", "dx", "dweight"] + (["dleft"] if packed else [])
    errs = dict(zip(names, [rel_l2(y, ry)] + [rel_l2(a, b) for a, b in zip(gr, rg)]))
    eager_errs = dict(zip(names, [rel_l2(by, ry)] + [rel_l2(a, b) for a, b in zip(bg, rg)]))
    same = (y == by).float().mean().item()
    print(f"\nfused conv s={s} packed={packed}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
          + " | eager bf16: " + " ".join(f"{n}={e:.2e}" for n, e in eager_errs.items())
          + f" | outputs bitwise equal to eager bf16: {same:.4f}")
    for t in (y, *gr):
        assert torch.isfinite(t).all()
    for n, e in errs.items():
        assert e < TOL, f"{n}: rel-L2 {e:.3e} >= {TOL}"
    y2, gr2 = fused(x, w, left, starts, dys)
    assert torch.equal(y, y2) and all(torch.equal(a, b) for a, b in zip(gr, gr2)), "not deterministic"


def _compiled() -> dict[str, int]:
    from deltacp.ops.fused import conv

    return {n: sum(len(c[0]) for c in f.device_caches.values())
            for n, f in vars(conv).items() if n.endswith("_kernel")}


def test_no_recompile_across_lengths():
    """After one step of each kind (unpacked without a left context; packed with one), other lengths compile
    nothing."""

    def step(s, packed, seed):
        fused(*make(s, packed, seed))
        torch.cuda.synchronize()

    for packed in (False, True):
        step(1000, packed, 0)
    first = _compiled()
    for s, seed in ((4096 + 37, 1), (777, 2), (2048, 3), (64 * 17, 4), (3, 5), (1, 6)):
        for packed in (False, True):
            if packed and s < 8:
                continue  # make() packs 3s tokens with median s/16; the kernel itself takes any s >= 1
            step(s, packed, seed)
    after = _compiled()
    print(f"\ncompiled fused-conv kernels after the first lengths: {first}\nafter more lengths: {after}")
    assert after == first, {n: (first.get(n), c) for n, c in after.items() if first.get(n) != c}


def _time_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("s", [16384, 65536])
def test_timing(s, packed):
    """Prints forward, backward and forward + backward of the fused kernel and of today's eager path, and the
    HBM traffic rate of the fused kernels (forward: x read, q/k/v written; backward: x, dq/dk/dv read, dpre
    written, then dpre read, dx written: 5 x the bytes of x)."""
    from deltacp.ops.fused import conv as F
    from deltacp.ops.gdn.eager import causal_conv_silu, split_qkv

    x, w, left, starts, dys = make(s, packed)
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    lg = None if left is None else left.detach().requires_grad_()
    leaves = [t for t in (xg, wg, lg) if t is not None]

    def fused_fwd():
        return F.conv_silu_split(xg, wg, None, 1, left_BhC=lg, doc_start_s=starts, split=SPLIT)

    def eager_fwd():  # today's path: conv (+ per-document fix), SiLU, split, p2p's .contiguous()
        y = causal_conv_silu(xg, wg, None, 1, lg, starts)
        return tuple(t.contiguous() for t in split_qkv(y, 16, 128, 128))

    def fwd_bwd(f):
        def run():
            outs = f()
            torch.autograd.grad(outs, leaves, [d.view_as(o) for d, o in zip(dys, outs)])
        return run

    def bwd_only(f):
        outs = f()

        def run():
            torch.autograd.grad(outs, leaves, [d.view_as(o) for d, o in zip(dys, outs)], retain_graph=True)
        return run

    with torch.no_grad():
        t_ff, t_ef = _time_ms(fused_fwd), _time_ms(eager_fwd)
    t_fb, t_eb = _time_ms(bwd_only(fused_fwd)), _time_ms(bwd_only(eager_fwd))
    t_fa, t_ea = _time_ms(fwd_bwd(fused_fwd)), _time_ms(fwd_bwd(eager_fwd))
    mb = x.numel() * x.element_size() / 1e6  # megabytes: MB per ms is GB per s
    print(f"\nconv s={s} packed={packed} (C={C}, bf16; blocks fwd {F.FWD_BLOCKS} bwd {F.BWD_DPRE_BLOCKS} "
          f"+ {F.BWD_DX_BLOCKS}): "
          f"fused fwd {t_ff:.3f} ms ({2 * mb / t_ff:.0f} GB/s), bwd {t_fb:.3f} ms ({5 * mb / t_fb:.0f} GB/s), "
          f"f+b {t_fa:.3f} ms | eager fwd {t_ef:.3f} ms, bwd {t_eb:.3f} ms, f+b {t_ea:.3f} ms | "
          f"speed-up f+b {t_ea / t_fa:.2f}x")


@pytest.mark.parametrize("s", [65536])
def test_block_sweep(s):
    """Prints forward and backward times of a few block shapes (tokens, channels, warps) at the packed shape, for
    choosing FWD_BLOCKS / BWD_DPRE_BLOCKS / BWD_DX_BLOCKS: each kernel's candidates are swept with the others at
    their defaults (each shape compiles its own variant; the defaults are restored). The backward's two passes
    are timed together (autograd runs both)."""
    from deltacp.ops.fused import conv as F

    x, w, left, starts, dys = make(s, True)
    xg, wg, lg = (t.detach().requires_grad_() for t in (x, w, left))
    keep = F.FWD_BLOCKS, F.BWD_DPRE_BLOCKS, F.BWD_DX_BLOCKS
    sweeps = {
        "FWD_BLOCKS": ((32, 128, 4), (16, 128, 4), (32, 64, 4), (64, 128, 8)),
        "BWD_DPRE_BLOCKS": ((16, 64, 4), (16, 64, 8), (32, 64, 8), (16, 128, 8), (8, 128, 4), (32, 64, 4)),
        "BWD_DX_BLOCKS": ((64, 64, 4), (32, 64, 4), (32, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8)),
    }
    lines = []
    try:
        for name, cands in sweeps.items():
            for blocks in cands:
                F.FWD_BLOCKS, F.BWD_DPRE_BLOCKS, F.BWD_DX_BLOCKS = keep
                setattr(F, name, blocks)

                def fwd():
                    return F.conv_silu_split(xg, wg, None, 1, left_BhC=lg, doc_start_s=starts, split=SPLIT)

                with torch.no_grad():
                    t_f = _time_ms(fwd)
                outs = fwd()
                t_b = _time_ms(lambda: torch.autograd.grad(outs, (xg, wg, lg), dys, retain_graph=True))
                lines.append(f"  {name} {blocks}: fwd {t_f:.3f} ms, bwd {t_b:.3f} ms")
    finally:
        F.FWD_BLOCKS, F.BWD_DPRE_BLOCKS, F.BWD_DX_BLOCKS = keep
    print(f"\nfused conv block sweep, s={s} packed (defaults fwd {keep[0]} dpre {keep[1]} dx {keep[2]}):\n"
          + "\n".join(lines))
