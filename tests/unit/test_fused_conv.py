"""CPU (TRITON_INTERPRET=1) tests of the fused causal conv + SiLU + q/k/v split (`deltacp.ops.fused.conv`) against
the eager path (`deltacp.ops.gdn.eager.causal_conv_silu`, the reference the eager backend runs). Need triton (CI
installs none: skip).

Per case (B, s, channels and their q/k/v split, kernel, dilation, left context or zeros, bias or none, document
starts, x a strided slice of a wider tensor or not): the three outputs (contiguous, x's dtype) and the gradients of
x, weight, bias and the left context, for
  - fp32 inputs: vs eager fp32 and vs eager fp64 on the same values, rel-L2 < 1e-6 (fp32 rounding only);
  - fp64 inputs (two cases): vs eager fp64, rel-L2 < 1e-12 (the kernel computes in fp64);
  - bf16 inputs (x, weight, bias, left, dy all bf16; six cases): vs eager bf16 on the same values. The forward
    rounds as eager does (conv in fp32 -> bf16, SiLU in fp32 -> bf16): outputs bitwise equal to eager's wherever
    eager does not recompute a token for its document (>= 99% required; 100% seen), rel-L2 < BF16_OUT overall (eager's
    per-document fix rounds its einsum and bias add separately); gradients within BF16_GRAD (the kernel rounds SiLU's
    derivative product to bf16 before the conv backward, as eager does: bitwise equal without documents), and no
    further from the
    fp64 result than eager's (x 1.1 + 1e-3). The interpreter's fp32 -> bf16 cast truncates; it is patched to
    round to nearest even, as the GPU does (`_patch_interpreter_bf16_round`).
Documents: starting at local 0 (with a left context: the halo is another document's), inside the halo
(negative start > -halo), length-1 documents, a document that began long before the slice; s smaller than the
halo, s = 1, s not a multiple of the block size, one backward pass-1 program looping over all its token blocks
(BWD_PROGRAMS = 1: same results as the default split into spans), channels spanning two channel blocks with q/k/v
boundaries inside a block. Then the two backends' `conv_silu_split` (heads layout) on a packed row's middle slice
with the document starts of `DocumentSegment`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None

BF16_OUT = 6e-3
BF16_GRAD = 1e-2



def _patch_interpreter_bf16_round():
    """Triton's interpreter casts fp32 -> bf16 by truncation (its `_convert_float` without a rounding mode); the GPU
    rounds to nearest even (cvt.rn), as torch does. Make the interpreter round like the GPU, so that the kernel's
    two roundings can be compared with eager's bitwise."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    if getattr(it.InterpreterBuilder.cast_impl, "_deltacp_patched", False):
        return
    orig = it.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded = np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)
            return it.TensorHandle(rounded, tl.bfloat16)
        return orig(self, src, dst_type)

    cast_impl._deltacp_patched = True
    it.InterpreterBuilder.cast_impl = cast_impl


_CODE = r"""
import sys, torch
sys.path.insert(0, {testdir!r})
import test_fused_conv as t
t._patch_interpreter_bf16_round()
import deltacp.ops.fused.conv as F
from deltacp.ops.gdn.eager import causal_conv_silu

BF16_OUT, BF16_GRAD = {bf16_out}, {bf16_grad}


def rel(a, b):
    a, b = a.double(), b.double()
    n = b.norm()
    return ((a - b).norm() / n).item() if n > 0 else a.norm().item()


def starts_of(s, kind, halo):
    t = torch.arange(s)
    if kind is None:
        return None
    if kind == "zero":           # one document starting at local 0 (the left context is another document's)
        st = torch.zeros(s)
    elif kind == "mixed":        # a document begun long before the slice, then documents of 1, 1, 4, ... tokens
        bounds = [b for b in (3, 4, 5, 9, s - 1) if 0 < b < s]   # 3, 4: length-1 documents
        st = torch.full((s,), -1000)
        for b in bounds:
            st[t >= b] = b
    elif kind == "in_halo":      # the first document began 2 tokens before the slice (inside the halo), then len-1
        st = torch.full((s,), -min(2, halo))
        for b in (1, 2, 6):
            if b < s:
                st[t >= b] = b
    elif kind == "each":         # every token its own document
        st = t.clone()
    else:
        raise ValueError(kind)
    return st.to(torch.int32)


# name: B, s, split, kernel, dilation, left, bias, starts, strided
CASES = {{
    "plain":           (2, 37, (16, 16, 16), 4, 1, False, True, None, True),
    "left+docs":       (1, 41, (16, 16, 32), 4, 1, True, False, "mixed", True),
    "left+doc at 0":   (2, 19, (8, 8, 16), 4, 1, True, True, "zero", False),
    "in halo":         (1, 23, (8, 8, 16), 4, 1, True, True, "in_halo", True),
    "dilation 2":      (1, 33, (8, 8, 16), 4, 2, True, True, "mixed", True),
    "s < halo":        (2, 5, (8, 8, 16), 4, 2, True, True, "in_halo", True),
    "s = 1":           (1, 1, (8, 8, 16), 4, 1, True, True, None, False),
    "len-1 docs":      (1, 9, (8, 8, 16), 4, 1, True, True, "each", False),
    "kernel 8":        (1, 20, (8, 8, 16), 8, 1, True, True, "mixed", True),
    "kernel 2 dil 3":  (1, 17, (8, 8, 16), 2, 3, False, True, "mixed", True),
    "2 channel blocks": (1, 40, (40, 40, 80), 4, 1, True, True, "mixed", True),
}}

LOOPED = {{"2 channel blocks"}}   # backward with BWD_PROGRAMS = 1: one program loops over all blocks

worst = {{}}


def run(name, dt):
    B, s, split, KW, dil, with_left, with_bias, kind, strided = CASES[name]
    C = sum(split)
    halo = (KW - 1) * dil
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    r = lambda *sh: torch.randn(*sh, generator=g)  # noqa: E731
    wide = r(B, s, C + 7)
    x = wide[..., 3:3 + C] if strided else wide[..., :C].contiguous()
    w, b, left = r(C, KW) * 0.5, r(C) * 0.3 if with_bias else None, r(B, halo, C) if with_left else None
    st = starts_of(s, kind, halo)
    dy = [r(B, s, n) for n in split]
    inputs = [x, w, b, left]
    names = ["x", "weight", "bias", "left"]

    def leaves_of(dtype):
        leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
        if strided:  # x a view of a wider tensor of this dtype
            leaves[0] = wide.to(dtype)[..., 3:3 + C].requires_grad_()
            assert not leaves[0].is_contiguous()
        return leaves

    def ours(dtype):
        lv = leaves_of(dtype)
        outs = F.conv_silu_split(lv[0], lv[1], lv[2], dil, left_BhC=lv[3], doc_start_s=st, split=split)
        for o, n in zip(outs, split):
            assert o.is_contiguous() and o.shape == (B, s, n) and o.dtype == dtype, (name, o.shape, o.dtype)
        y = torch.cat(outs, -1)
        used = [t for t in lv if t is not None]
        grads = torch.autograd.grad(sum((o.float() * d.to(dtype).float()).sum() for o, d in zip(outs, dy)), used)
        it = iter(grads)
        return y.detach(), [None if t is None else next(it) for t in lv]

    def eager(dtype):
        lv = leaves_of(dtype)
        y = causal_conv_silu(lv[0], lv[1], lv[2], dil, lv[3], st)
        used = [t for t in lv if t is not None]
        dyc = torch.cat(dy, -1).to(dtype)
        grads = torch.autograd.grad((y * dyc).sum(), used)
        it = iter(grads)
        return y.detach(), [None if t is None else next(it) for t in lv]

    y, gr = ours(dt)
    if name in LOOPED:  # the same through one backward program per row and channel block (looping over spans)
        keep, F.BWD_PROGRAMS = F.BWD_PROGRAMS, 1
        try:
            y2, gr2 = ours(dt)
        finally:
            F.BWD_PROGRAMS = keep
        assert torch.equal(y, y2) and all(a is None or torch.allclose(a, c, rtol=1e-5, atol=1e-6)
                                          for a, c in zip(gr, gr2)), (name, "looped backward")
    ye, ge = eager(dt)
    y64, g64 = eager(torch.float64)
    errs = {{"y": rel(y, ye)}}
    errs.update({{"d" + n: rel(a, e) for n, a, e in zip(names, gr, ge) if a is not None}})
    e64 = {{"y": rel(y, y64)}}
    e64.update({{"d" + n: rel(a, e) for n, a, e in zip(names, gr, g64) if a is not None}})
    eager64 = {{"y": rel(ye, y64)}}
    eager64.update({{"d" + n: rel(a, e) for n, a, e in zip(names, ge, g64) if a is not None}})
    tag = str(dt).split(".")[-1]
    print("%-17s %-8s vs eager: %s | vs fp64: %s" % (name, tag, " ".join("%s=%.1e" % kv for kv in errs.items()),
                                                   " ".join("%s=%.1e" % kv for kv in e64.items())))
    for k, v in errs.items():
        worst[(tag, k)] = max(worst.get((tag, k), 0.0), v)
    if dt == torch.float32:
        bad = {{k: v for k, v in {{**errs, **{{"64 " + k: v for k, v in e64.items()}}}}.items() if not v < 1e-6}}
    elif dt == torch.float64:
        bad = {{k: v for k, v in errs.items() if not v < 1e-12}}
    else:
        # bitwise equal but where eager's per-document fix recomputes a token (its einsum and bias add round
        # twice in bf16; the kernel rounds once, as the plain conv does)
        plain = torch.ones(s, dtype=torch.bool) if st is None else torch.arange(s) - st >= halo
        same = (y == ye)[:, plain].double().mean().item() if bool(plain.any()) else 1.0
        worst[(tag, "equal fraction")] = min(worst.get((tag, "equal fraction"), 1.0), same)
        bad = {{k: v for k, v in errs.items() if not v < (BF16_OUT if k == "y" else BF16_GRAD)}}
        bad.update({{"64 " + k: (v, eager64[k]) for k, v in e64.items() if not v <= 1.1 * eager64[k] + 1e-3}})
        if same < 0.99:
            bad["bitwise-equal fraction"] = same
    assert not bad, (name, tag, bad)


F64_CASES = {{"left+docs", "dilation 2"}}
BF16_CASES = {{"plain", "left+docs", "in halo", "s < halo", "len-1 docs", "2 channel blocks"}}
for name in CASES:
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        if dt == torch.float32 or name in (F64_CASES if dt == torch.float64 else BF16_CASES):
            run(name, dt)
# the backends' contract method: the Triton one (this kernel, reshaped to heads) vs the eager one (conv + fix, then
# split_qkv views), on a middle slice of a packed row with its document starts from DocumentSegment
from deltacp.ops.gdn.eager import EagerGDNBackend
from deltacp.ops.gdn.triton import TritonGDNBackend
from deltacp.parallel.documents import DocumentSegment

heads = (2, 8, 8)  # q/k: 2 heads of 8, v: 4 heads of 8
seg = DocumentSegment.build(torch.tensor([0, 5, 30, 31, 32, 50, 90]), 29, 58)
st = seg.doc_starts("cpu")
assert st.dtype == torch.int32 and st[:3].tolist() == [-24, 1, 2] and st[-1].item() == 21
wide = torch.randn(1, 29, 70)
x, w, left = wide[..., 5:69], torch.randn(64, 4), torch.randn(1, 3, 64)
outs = [be.conv_silu_split(x, w, None, 1, left_BhC=left, doc_start_s=st, heads=heads)
        for be in (TritonGDNBackend(), EagerGDNBackend())]
for a, e, shape in zip(*outs, [(1, 29, 2, 8), (1, 29, 2, 8), (1, 29, 4, 8)]):
    assert a.shape == e.shape == shape and a.is_contiguous() and rel(a, e) < 1e-6, (a.shape, e.shape, rel(a, e))
print("backends agree")
print("worst", " ".join("%s/%s=%.2e" % (t, k, v) for (t, k), v in sorted(worst.items())))
"""


def _run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 test of the fused conv "
                                           "runs only where triton is (test.sh installs it)")
def test_fused_conv_vs_eager_under_interpreter():
    out = _run(_CODE.format(bf16_out=BF16_OUT, bf16_grad=BF16_GRAD,
                            testdir=os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    print(out.stdout)


@pytest.mark.fast
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_conv_refuses_bad_inputs():
    """Checked before any launch (no GPU, no interpreter needed)."""
    import torch

    from deltacp.ops.fused.conv import conv_silu_split

    x, w = torch.randn(1, 8, 12), torch.randn(12, 4)
    cases = {
        "kernel width": dict(weight_CK=torch.randn(12, 9)),
        "dilation": dict(dilation=0),
        "split": dict(split=(4, 4, 5)),
        "left context": dict(left_BhC=torch.randn(1, 2, 12)),              # the halo is 3
        "of x's dtype": dict(left_BhC=torch.randn(1, 3, 12).double()),
        "doc_start_s": dict(doc_start_s=torch.zeros(8)),                     # float
        "doc_start_s ": dict(doc_start_s=torch.zeros(7, dtype=torch.int32)),  # length
        "bias": dict(bias_C=torch.randn(11)),
    }
    for words, case in cases.items():
        kw = {**dict(weight_CK=w, bias_C=None, dilation=1, split=(4, 4, 4)), **case}
        with pytest.raises(ValueError, match=words.strip()):
            conv_silu_split(x, kw.pop("weight_CK"), kw.pop("bias_C"), kw.pop("dilation"), **kw)


@pytest.mark.fast
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_conv_lengths_are_runtime_values():
    """The sequence length (and what scales with it: the row stride of x, the backward's span) is never a
    compile-time constant nor specialised on (value 1, divisibility by 16): one compile per model shape. The GPU
    test counts compiled variants across lengths."""
    import inspect

    from deltacp.ops.fused import conv

    kernels = {n: f for n, f in vars(conv).items() if n.endswith("_kernel")}
    assert len(kernels) == 3, sorted(kernels)
    bad = []
    for name, f in kernels.items():
        params = list(inspect.signature(f.fn).parameters)
        assert "s" in params and ("stride_xb" in params or "x" not in params), (name, params)
        constexpr = {params[i] for i in f.constexprs}
        dns = {params[i] if isinstance(i, int) else i for i in f.do_not_specialize}
        bad += [(name, p) for p in ("s", "stride_xb", "span") if p in params and (p in constexpr or p not in dns)]
    assert not bad, bad
