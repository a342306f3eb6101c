"""CPU (TRITON_INTERPRET=1) tests of the Triton backend on packed documents (`cu_seqlens`), against the eager
backend's float64 varlen results, and of the kernels' runtime lengths. Need triton (test.sh installs it).

Per case (documents not aligned to 64, length-1 documents, seven tiny documents; first_continues True/False; the
many-document rows at real shapes are the GPU test's, tests/gpu/test_triton_varlen_gpu.py):
  - fp32 inputs (the kernels then compute in fp32 end to end; first_continues True only: the precision check): o,
    final state, all six gradients, dH0 from dO (`initial_state_grad`), summary (M, S) vs eager fp64, rel-L2 < 1e-5
    (the bound of the unpacked interpreter test).
  - bf16 inputs (the production dtypes): the same quantities vs eager fp64 on the same bf16 values, rel-L2 < 2.5e-2
    (bf16 products and a bf16 per-chunk state at K = V = 32: the unpacked op itself, the "one doc" case, which is
    bitwise the unpacked op, is at 1.7e-2 for o here), and BITWISE equal to running the Triton op on
    each document alone (what the packed layout must reproduce exactly), and to the p2p staged path
    (`prepare_chunks` shared by summary, output pass and dH_in pass).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None

_CODE = r"""
import sys, torch
import os; sys.path.insert(0, os.path.dirname({testdir!r}))
import triton_interpreter
triton_interpreter.patch()  # the bf16 dot fix and the nested-call speed-up (tests/triton_interpreter.py)
from deltacp.ops.gdn import eager as E
from deltacp.ops.gdn.triton import TritonGDNBackend
from deltacp.ops.gdn.varlen import VarlenLayout

be = TritonGDNBackend()
Hk, Hv, K, V = 1, 2, 32, 32
NAMES = ("q", "k", "v", "g", "beta", "h0")
CASES = {{
    "unaligned+len1": [1, 69, 1, 129, 3],
    "tiny docs": [2, 1, 1, 5],  # one chunk each (the state kernels: one program per document)
    "one doc": [150],
}}


def inputs(T, dt, seed):
    g_ = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g_)  # noqa: E731
    q, k, v = r(1, T, Hk, K).to(dt), r(1, T, Hk, K).to(dt), r(1, T, Hv, V).to(dt)
    g = -torch.rand(1, T, Hv, generator=g_) * 0.2
    beta = torch.rand(1, T, Hv, generator=g_).to(dt)
    return q, k, v, g, beta, r(1, Hv, K, V) * 0.3


def run_triton(xs, do, dht, cu, prepared=None):
    leaves = [x.clone().requires_grad_() for x in xs]
    o, ht = be.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu, prepared=prepared)
    gr = torch.autograd.grad((o.float() * do).sum() + (ht * dht).sum(), leaves)
    return [o.detach(), ht.detach(), *gr]


def run_eager(xs, do, dht, cu):
    leaves = [x.double().clone().requires_grad_() for x in xs]
    o, ht = E.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    gr = torch.autograd.grad((o * do.double()).sum() + (ht * dht.double()).sum(), leaves, allow_unused=True)
    return [o.detach(), ht.detach()] + [torch.zeros_like(x) if a is None else a for a, x in zip(gr, leaves)]


def rel(a, b):
    a, b = a.double(), b.double()
    n = b.norm()
    return ((a - b).norm() / n).item() if n > 0 else a.norm().item()


worst = {{"fp32": 0.0, "bf16": 0.0}}
for name in sys.argv[1:]:  # the cases this process runs
    lens = CASES[name]
    T = sum(lens)
    cu_t = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    for first in (True, False):
        lay = VarlenLayout.build(cu_t, T, first_continues=first)
        # plain offsets mean first_continues=True: pass the tensor itself in that case (the other input form)
        cu = cu_t if first else lay
        # fp32 (the kernels' precision against float64) once per case; bf16 (the layout, bitwise) both ways
        for dt in (torch.float32, torch.bfloat16) if first else (torch.bfloat16,):
            tag = "fp32" if dt == torch.float32 else "bf16"
            xs = inputs(T, dt, seed=len(lens) + 7 * first)
            g_out = torch.Generator().manual_seed(100 + len(lens) + 7 * first)  # the same cotangents every run
            do = torch.randn(1, T, Hv, V, generator=g_out).to(dt).float()
            dht = torch.randn(1, Hv, K, V, generator=g_out)
            ours = run_triton(xs, do, dht, cu)
            ref = run_eager(xs, do, dht, lay)
            errs = {{"o": rel(ours[0], ref[0]), "ht": rel(ours[1], ref[1])}}
            errs.update({{"d" + n: rel(a, b) for n, a, b in zip(NAMES, ours[2:], ref[2:])}})
            q, k, v, g, beta, h0 = xs
            dh0_o = be.initial_state_grad(q, k, v, g, beta, do.to(dt), use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            rdh0_o = E.initial_state_grad(*(x.double() for x in (q, k, v, g, beta)), do.double(),
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=lay)
            errs["dH0 from dO"] = rel(dh0_o, rdh0_o)
            # summary: slow gates and small beta so that M stays O(1) where it is not 0
            gs_, bs_ = g * 0.05, (beta.float() * 0.1).to(dt)
            with torch.no_grad():
                M, S = be.state_summary(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            RM, RS = E.state_summary(*(x.double() for x in (k, v, gs_, bs_)), use_qk_l2norm_in_kernel=True,
                                     cu_seqlens=lay)
            errs["M"], errs["S"] = rel(M, RM), rel(S, RS)
            if lay.any_reset:
                assert torch.count_nonzero(M) == 0 and torch.count_nonzero(RM) == 0, "M must be 0 after a reset"
            else:
                assert RM.norm() > 0.2 * (Hv * K) ** 0.5, "M must not be negligible: %g" % RM.norm()
            if not first:
                assert torch.count_nonzero(ours[7]) == 0 and torch.count_nonzero(dh0_o) == 0, "dh0 must be 0"
            for x in ours + [dh0_o, M, S]:
                assert torch.isfinite(x).all()
            print(name, "first_continues=%s" % first, tag, " ".join("%s=%.1e" % kv for kv in errs.items()))
            worst[tag] = max(worst[tag], max(errs.values()))
            if dt != torch.bfloat16:
                continue
            # bitwise: each document on its own through the Triton op (the entering state feeds document 0 only
            # if it continues; the final state and its gradient belong to the last document)
            cu_l = cu_t.tolist()
            per_doc = {{n: [] for n in ("o", "dq", "dk", "dv", "dg", "dbeta")}}
            for d in range(len(lens)):
                s, e = cu_l[d], cu_l[d + 1]
                seg = [x[:, s:e].clone().requires_grad_() for x in xs[:5]]
                h0d = h0.clone().requires_grad_() if (d == 0 and first) else None
                last = d == len(lens) - 1
                o_d, ht_d = be.chunk_gated_delta_rule(*seg, initial_state=h0d, output_final_state=last,
                                                      use_qk_l2norm_in_kernel=True)
                loss = (o_d.float() * do[:, s:e]).sum() + ((ht_d * dht).sum() if last else 0)
                leaves = seg + ([h0d] if h0d is not None else [])
                gd = torch.autograd.grad(loss, leaves)
                per_doc["o"].append(o_d.detach())
                for n, x in zip(("dq", "dk", "dv", "dg", "dbeta"), gd[:5]):
                    per_doc[n].append(x)
                if last:
                    assert torch.equal(ht_d, ours[1]), (name, first, "final state vs last document")
                if d == 0:
                    want = gd[5] if first else torch.zeros_like(h0)
                    assert torch.equal(ours[7], want), (name, first, "dh0 vs document 0")
                    want = (be.initial_state_grad(*(x[:, s:e] for x in (q, k, v, g, beta)), do[:, s:e].to(dt),
                                                  use_qk_l2norm_in_kernel=True) if first else torch.zeros_like(h0))
                    assert torch.equal(dh0_o, want), (name, first, "initial_state_grad vs document 0")
            for i, n in enumerate(("o", "dq", "dk", "dv", "dg", "dbeta")):
                got = ours[0] if n == "o" else ours[1 + i]
                assert torch.equal(got, torch.cat(per_doc[n], 1)), (name, first, n, "vs per-document runs")
            with torch.no_grad():
                _, S_last = be.state_summary(*(x[:, cu_l[-2]:] for x in (k, v, gs_, bs_)), need_transition=False,
                                             use_qk_l2norm_in_kernel=True)
            if lay.any_reset:
                assert torch.equal(S, S_last), (name, first, "S vs the last document's")
            # p2p's staged path: one prepare_chunks (chunk-aligned layout) shared by the three calls
            P = be.prepare_chunks(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            assert P.ai.shape[1] == lay.padded
            with torch.no_grad():
                M2, S2 = be.state_summary(k, v, gs_, bs_, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, prepared=P)
            assert torch.equal(M2, M) and torch.equal(S2, S), (name, first, "summary from prepared")
            P = be.prepare_chunks(k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            staged = run_triton(xs, do, dht, cu, prepared=P)
            assert all(torch.equal(a, b) for a, b in zip(staged, ours)), (name, first, "output pass from prepared")
            dh0_p = be.initial_state_grad(q, k, v, g, beta, do.to(dt), use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                          prepared=be.prepared_from_saved(P.tensors_for_backward()))
            assert torch.equal(dh0_p, dh0_o), (name, first, "dH_in pass from prepared")
            if not lay.any_reset:  # one continuing document: exactly the unpacked op
                assert all(torch.equal(a, b) for a, b in zip(run_triton(xs, do, dht, None), ours)), "vs unpacked"
print("worst", worst["fp32"], worst["bf16"])
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 varlen test runs only "
                                           "where triton is (test.sh installs it)")
def test_interpreter_varlen_vs_eager_fp64():
    """The cases in two processes at once (the interpreter runs one core each: twice as fast on two cores)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _CODE.format(testdir=os.path.dirname(os.path.abspath(__file__)))
    parts = [["unaligned+len1"], ["tiny docs", "one doc"]]
    procs = [subprocess.Popen([sys.executable, "-c", code, *names], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for names in parts]
    outs = [proc.communicate(timeout=900) + (proc.returncode,) for proc in procs]
    stdout = "".join(out for out, _, _ in outs)
    for out, err, code in outs:
        assert code == 0, out[-3000:] + err[-3000:]
    print(stdout)
    worst = [[float(x) for x in out.strip().splitlines()[-1].split()[1:]] for out, _, _ in outs]
    fp32, bf16 = (max(w[i] for w in worst) for i in (0, 1))
    for name in sum(parts, []):  # each case: first_continues True (fp32 and bf16) and False (bf16)
        assert sum(line.startswith(name + " first_continues") for line in stdout.splitlines()) == 3, (name, stdout)
    assert fp32 < 1e-5, stdout
    assert bf16 < 2.5e-2, stdout


_NO_RESPECIALISE_CODE = r"""
import inspect
from deltacp.ops.gdn.triton import chunk_h, chunk_o, heads, l2norm, wy

kernels = [(m.__name__, n, f) for m in (chunk_h, chunk_o, heads, l2norm, wy) for n, f in vars(m).items()
           if n.endswith("_kernel")]
assert len(kernels) >= 12, [n for _, n, _ in kernels]
bad = []
for mod, name, f in kernels:
    params = list(inspect.signature(f.fn).parameters)
    lengths = [p for p in ("T", "NT", "N") if p in params]
    assert lengths, (name, params)
    constexpr = {{params[i] for i in f.constexprs}}
    dns = {{params[i] if isinstance(i, int) else i for i in f.do_not_specialize}}
    for p in lengths:
        if p in constexpr or p not in dns:
            bad.append((name, p, "constexpr" if p in constexpr else "specialised"))
assert not bad, bad
print("ok", len(kernels))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_lengths_are_runtime_values():
    """No kernel takes the sequence length, the chunk count or the row count as a compile-time constant or
    specialises on it (value 1, divisibility by 16), so a packed stream with a new length every step compiles each
    kernel once. (The GPU test `test_no_recompile_across_lengths` counts the compiled kernels.)"""
    out = subprocess.run([sys.executable, "-c", _NO_RESPECIALISE_CODE.format()], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.fast
def test_kernel_tables():
    """The Triton kernels' view of a packed row (no triton needed): per chunk of the chunk-aligned layout its first
    token and token count, per document its first token and first chunk (last row: the totals)."""
    import torch

    from deltacp.ops.gdn.varlen import VarlenLayout

    lens = [1, 69, 1, 129, 3]
    lay = VarlenLayout.build(torch.tensor([0] + lens).cumsum(0), sum(lens))
    chunks, docs = lay.chunk_table("cpu"), lay.doc_table("cpu")
    assert chunks.dtype == docs.dtype == torch.int32
    assert chunks.tolist() == [[0, 1], [1, 64], [65, 5], [70, 1], [71, 64], [135, 64], [199, 1], [200, 3]]
    assert docs.tolist() == [[0, 0], [1, 1], [70, 3], [71, 4], [200, 7], [203, 8]]
    assert chunks.shape[0] * 64 == lay.padded and int(chunks[:, 1].sum()) == lay.total
    # a chunk starts a document exactly where the layout's state resets (first_continues: not chunk 0)
    starts = {int(t) for t in lay.cu_seqlens[:-1]}
    assert [int(t) in starts and i > 0 for i, t in enumerate(chunks[:, 0])] == lay.chunk_resets
