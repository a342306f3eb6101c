"""CPU (TRITON_INTERPRET=1) test of the Triton selected attention (`deltacp.ops.selected_attention_kernels`, the
CUDA path of the indexed attention layers) against the gathered kernel (`gathered_attention`, itself checked against
transformers' Qwen4-Exp indexer in tests/distributed/test_qwen4_exp.py) in float32 on the same inputs. Needs triton
(skipped where it is not installed).

One subprocess (the interpreter must be on before triton loads), one [2, 64] batch: row 0 four packed documents
(lengths 5, 1, 20, 38), row 1 eleven padding tokens then one document; blocks of 6 (runs shorter than the 16-wide
key tile), 3 chosen blocks a query (fewer than most queries see), scores drawn at random; 4 query heads over 2 KV
heads (G = 2, padded to 16 rows), head dim 24 (not a power of two); the odd positions as queries (a rank's queries
against the whole row's keys). Output and the gradients of q, k, v (dk, dv by the per-run kernel) within 1e-5 of
the largest reference value (fp32 products; the figures are ~1e-7). A selection without its tails changes the
output (checked: the test sees them).
Head dims over 256 (the wide launches of GLM-5.3-Flash's absorbed MLA: blocks of at most 16 query heads a program)
in the same process, against a float64 dense reference written here (softmax under the selection's token mask): 512
with one tensor as the keys and the values (GLM's latent, one KV head) read by 20 query heads (two head blocks, the
second part-filled), and 320 over 2 KV heads (not a power of two: tiles padded to 512 columns); rel-L2 within 1e-5
(the figures are ~2e-7). About 22 s on 2 cores (the wide cases 7 s of it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CODE = f"import sys; sys.path.insert(0, {TESTS!r})\n" + r"""
import torch
import triton_interpreter
triton_interpreter.patch()
from deltacp.ops import selected_attention as sa
from deltacp.testing.documents import cu_of
from deltacp.testing.selection import random_selection

def case(cu, size, D, rows, seed):
    B, S = 2, 64
    sel = random_selection(cu, B, S, size, 3, seed, "cpu")
    if rows is not None:
        sel = sa.Selection(*(x[:, rows] for x in (sel.blocks, sel.ok, sel.tail_lo, sel.pos)), sel.block_start, size)
    s = sel.pos.shape[1]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, s, 4, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(B, S, 2, D, generator=gen, requires_grad=True) for _ in range(2))
    go = torch.randn(B, s, 4 * D, generator=gen)
    ref = sa.gathered_attention(q, k, v, *sel.token_index(), 0.3)
    out = sa.triton_selected_attention(q, k, v, sel, 0.3)
    pairs = [(out, ref), *zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go))]
    errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]
    no_tail = sa.Selection(sel.blocks, sel.ok, sel.pos + 1, sel.pos, sel.block_start, size)
    wrong = sa.triton_selected_attention(q, k, v, no_tail, 0.3)
    return errs, bool(torch.allclose(wrong, ref, atol=1e-3))

def dense64(q, k, v, sel, scale):
    # float64 softmax attention under the selection's [s, S] mask (its token list), KV heads repeated
    index, valid = sel.token_index()
    B, s, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    mask = torch.zeros(B, s, S + 1, dtype=torch.bool).scatter_(-1, torch.where(valid, index, S), True)[..., :S]
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = (x.repeat_interleave(H // KV, dim=1) for x in (kd, vd))
    scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(1, 2).reshape(B, s, H * D)

def wide(D, H, KV, seed):
    # a head dim over WIDE_DIM in float32 (the wide launch: at most 16 query heads a program): one row of 48 tokens,
    # documents of 5, 1, 20, 22, its last 8 even positions as queries, H query heads; KV = 1: one tensor as keys and
    # values (GLM-5.3-Flash's absorbed latent). Worst rel-L2 of the output and the gradients against float64
    assert kernels.LAUNCH["fp32 wide"]["rows"] == 16
    S, s = 48, 8
    sel = random_selection(cu_of([5, 1, 20, 22]), 1, S, 6, 3, seed, "cpu")
    rows = torch.arange(S - 2 * s, S, 2)
    sel = sa.Selection(*(x[:, rows] for x in (sel.blocks, sel.ok, sel.tail_lo, sel.pos)), sel.block_start, 6)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, H, D, generator=gen, requires_grad=True)
    k = torch.randn(1, S, KV, D, generator=gen, requires_grad=True)
    v = k if KV == 1 else torch.randn(1, S, KV, D, generator=gen, requires_grad=True)
    go = torch.randn(1, s, H * D, generator=gen)
    leaves = (q, k) if KV == 1 else (q, k, v)
    out = sa.triton_selected_attention(q, k, v, sel, D ** -0.5)
    ref = dense64(q, k, v, sel, D ** -0.5)
    pairs = [(out, ref), *zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go.double()))]
    return max(((a.double() - b).norm() / b.norm()).item() for a, b in pairs)

cu = cu_of([5, 1, 20, 38, 11, 53])  # row 0: four packed documents; row 1: 11 padding tokens, then one document
errs, same = case(cu, 6, 24, torch.arange(1, 64, 2), 30)
print("RESULT", max(errs), not same)
from deltacp.ops import selected_attention_kernels as kernels
# 512 (GLM's latent, keys = values) read by 20 heads (two head blocks, the second part-filled), 320 over 2 KV heads
print("WIDE", wide(512, 20, 1, 31), wide(320, 4, 2, 32))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 test of the Triton "
                                           "selected attention runs only where triton is")
def test_triton_selected_attention_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(["src", TESTS]))
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1].split()
    worst, caught = float(line[1]), line[2] == "True"
    wide = [float(x) for x in [x for x in out.stdout.splitlines() if x.startswith("WIDE")][-1].split()[1:]]
    print(f"Triton selected attention vs gathered (fp32, interpreter): worst error {worst:.2e} of the largest value; "
          f"head dims 512 / 320 vs float64: worst rel-L2 {wide[0]:.2e} / {wide[1]:.2e}")
    assert worst < 1e-5
    assert caught, "a selection without its tails gave the same output: the test cannot see the tails"
    assert max(wide) < 1e-5, wide


@pytest.mark.fast
def test_triton_selected_attention_refuses_wide_heads():
    """A head dim over MAX_HEAD_DIM (512: GLM-5.3-Flash's absorbed latent) raises naming it and the limit, before any
    kernel loads; so do mixed dtypes."""
    import torch

    from deltacp.ops import selected_attention as sa
    from deltacp.testing.selection import random_selection

    sel = random_selection(torch.tensor([0, 32]), 1, 32, 4, 2, 0, "cpu")
    q, k = torch.randn(1, 32, 2, 576), torch.randn(1, 32, 1, 576)
    with pytest.raises(NotImplementedError, match=r"head dims up to 512.*got 576"):
        sa.triton_selected_attention(q, k, k, sel, 0.1)
    with pytest.raises(ValueError, match=r"one dtype"):
        sa.triton_selected_attention(q[..., :16].double(), k[..., :16], k[..., :16], sel, 0.1)
