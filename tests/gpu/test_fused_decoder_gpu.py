"""The fused decoder glue (`deltacp.ops.fused.decoder`) on CUDA at a real shape: 16384 tokens, hidden 2048, MLP
intermediate 6144, bfloat16 (Qwen3.5-2B's dims), against transformers' eager chain on the same values and a
float64 reference of that chain.

Checks (every count printed before it is asserted):
  - SwiGLU forward bitwise equal to F.silu(gate) * up in bf16 (libdevice expf = PyTorch's CUDA expf, IEEE
    division, exact bf16 products); the residual sum of add_rms_norm bitwise equal to torch's bf16 add;
  - RMSNorm / add+RMSNorm forward and dx, SwiGLU's dgate / dup: at most 1 element in 1000 one bf16 ulp off the eager
    chain (the fp32 sum order over the hidden dimension, FMA contraction);
  - every output and gradient (dweight included) vs float64: rel-L2 no worse than the eager chain's own (x 1.05,
    + 1e-6) and below 1e-2.
`test_timing`: fused vs eager, forward and forward + backward, CUDA events, 5 warm-up then the median of 20, and the
memory the forward keeps for backward. Run: python -m pytest tests/gpu/test_fused_decoder_gpu.py -s
"""

from __future__ import annotations


import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from timing import time_cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (Triton kernels); the CPU interpreter tests of the fused "
                                       "decoder glue are tests/unit/test_fused_decoder.py")

T, H, I, EPS = 16384, 2048, 6144, 1e-6
BF = torch.bfloat16


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def eager_norm(x, w, eps=EPS):
    """transformers' Qwen3_5RMSNorm on x, its weight the tensor w (so w's gradient is the module's)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    m = Qwen3_5RMSNorm(x.shape[-1], eps=eps)
    m._parameters["weight"] = w
    return m(x)


def exact_norm(x, w, eps=EPS):
    x, w = x.double(), w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def inputs(seed=0, wdtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=gen) * scale)  # noqa: E731
    return dict(x=r(T, H).to(BF), res=r(T, H, scale=4.0).to(BF), w=r(H, scale=0.3).to(wdtype),
                dy=r(T, H).to(BF), ds=r(T, H).to(BF), g=r(T, I, scale=3.0).to(BF), u=r(T, I).to(BF),
                dz=r(T, I).to(BF))


def run(fn, leaves, grads_out):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grads_out) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs])
    return [o.detach() for o in outs] + list(grads)


def compare(name, ours, eager, exact, bitwise=(), few=()):
    report = []
    for i, (a, b, c) in enumerate(zip(ours, eager, exact)):
        nd = int((a != b).sum())
        report.append((i, nd, a.numel(), rel(a, c), rel(b, c)))
    print(f"\n{name}: (index, elements differing from eager, numel, rel-L2 ours vs fp64, eager vs fp64)")
    for row in report:
        print("   ", row)
    for i, nd, n, r_ours, r_eager in report:
        if i in bitwise:
            assert nd == 0, (name, i, "bitwise", report)
        if i in few:
            assert nd <= n // 1000, (name, i, "one ulp in 1000", report)
        assert r_ours <= 1.05 * r_eager + 1e-6 and r_ours < 1e-2, (name, i, report)


@pytest.mark.parametrize("wdtype", [torch.float32, BF], ids=["w_fp32", "w_bf16"])
def test_norms_bf16_real_shape(wdtype):
    from deltacp.ops.fused.decoder import add_rms_norm, rms_norm

    d = inputs(wdtype=wdtype)
    ours = run(lambda x, w: rms_norm(x, w, EPS), [d["x"], d["w"]], [d["dy"]])
    eager = run(eager_norm, [d["x"], d["w"]], [d["dy"]])
    exact = run(exact_norm, [d["x"].double(), d["w"].double()], [d["dy"].double()])
    compare(f"rms_norm w={wdtype}", ours, eager, exact, few=(0, 1))

    ours = run(lambda x, r, w: add_rms_norm(x, r, w, EPS), [d["x"], d["res"], d["w"]], [d["dy"], d["ds"]])

    def eager_add(x, r, w):
        s = r + x
        return eager_norm(s, w), s

    def exact_add(x, r, w):
        s = r + x
        return exact_norm(s, w), s

    eager = run(eager_add, [d["x"], d["res"], d["w"]], [d["dy"], d["ds"]])
    # the float64 reference of the chain on the bf16-rounded sum (the sum's rounding is part of the chain)
    s = (d["res"] + d["x"]).double()
    exact = run(lambda s_, w: (exact_norm(s_, w), s_), [s, d["w"].double()], [d["dy"].double(), d["ds"].double()])
    exact = [exact[0], exact[1], exact[2], exact[2], exact[3]]
    compare(f"add_rms_norm w={wdtype}", ours, eager, exact, bitwise=(1,), few=(0, 2, 3))
    assert torch.equal(ours[2], ours[3])


def test_swiglu_bf16_real_shape():
    from deltacp.ops.fused.decoder import swiglu

    d = inputs()
    ours = run(swiglu, [d["g"], d["u"]], [d["dz"]])
    eager = run(lambda g, u: F.silu(g) * u, [d["g"], d["u"]], [d["dz"]])
    exact = run(lambda g, u: F.silu(g) * u, [d["g"].double(), d["u"].double()], [d["dz"].double()])
    compare("swiglu", ours, eager, exact, bitwise=(0,), few=(1, 2))


def _median_ms(fn, warmup=5, repeat=20) -> float:
    """bench/timing.py's CUDA-event median (warm-up, synchronised per call)."""
    return time_cuda(fn, warmup=warmup, repeat=repeat)["median_ms"]


def _time_case(fn, leaves, grads_out):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]

    def fwd():
        with torch.no_grad():
            fn(*leaves)

    def fwd_bwd():
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads_out) if g is not None]
        torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs])

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outs = fn(*leaves)
    kept = torch.cuda.memory_allocated() - before  # outputs + what autograd saved
    out_bytes = sum(o.numel() * o.element_size() for o in (outs if isinstance(outs, tuple) else (outs,)))
    del outs
    return _median_ms(fwd), _median_ms(fwd_bwd), (kept - out_bytes) / 2**20


def test_timing():
    from deltacp.ops.fused.decoder import add_rms_norm, rms_norm, swiglu

    d = inputs()

    def eager_add(x, r, w):
        s = r + x
        return eager_norm(s, w), s

    cases = [
        ("rms_norm", lambda x, w: rms_norm(x, w, EPS), eager_norm, [d["x"], d["w"]], [d["dy"]]),
        ("add_rms_norm", lambda x, r, w: add_rms_norm(x, r, w, EPS), eager_add, [d["x"], d["res"], d["w"]],
         [d["dy"], d["ds"]]),
        ("swiglu", swiglu, lambda g, u: F.silu(g) * u, [d["g"], d["u"]], [d["dz"]]),
    ]
    print(f"\nfused decoder glue, bf16, {T} tokens, hidden {H}, intermediate {I} ({torch.cuda.get_device_name()}); "
          f"median of 20 after 5 warm-up, CUDA events")
    print(f"{'op':<14}{'fused fwd':>11}{'eager fwd':>11}{'fused f+b':>11}{'eager f+b':>11}"
          f"{'saved MiB fused':>17}{'eager':>8}")
    for name, fused, eager, leaves, grads_out in cases:
        ff, fb, fm = _time_case(fused, leaves, grads_out)
        ef, eb, em = _time_case(eager, leaves, grads_out)
        print(f"{name:<14}{ff:>9.3f}ms{ef:>9.3f}ms{fb:>9.3f}ms{eb:>9.3f}ms{fm:>17.1f}{em:>8.1f}")
