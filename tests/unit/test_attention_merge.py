"""The one-pass tile merge (`deltacp.ops.fused.attention_merge.merge_`, the CUDA merge of `parallel/attention_tiles.py`)
on the CPU under TRITON_INTERPRET=1, in a subprocess (the interpreter must be set before triton loads):

- the op against the eager merge (`attention_tiles.merge_eager`) on the layouts the tiles hand it: the accumulator a
  strided slice of a longer [B, H, L, D] buffer, the tile's output contiguous or in [b, l, h, D] memory (cuDNN's
  layout), in float64 (rel-L2 < 1e-14), float32 and a bfloat16 tile into a float32 accumulator (< 1e-6); rows whose
  two statistics are both -inf give lse -inf and o 0 (the eager ops give NaN there); one -inf side leaves the other;
- the tiled attention with the kernel as its merge (packed documents, 8-token blocks: every query merged several
  times), float64, forward and backward, against the same with the eager merge: < 1e-13.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed: the TRITON_INTERPRET=1 tests of the tile merge run "
                                        "only where triton is")]

_CODE = r"""
import torch
from deltacp.ops.fused.attention_merge import merge_
from deltacp.parallel import attention_tiles as at

def rel(a, b):
    return ((a - b).norm() / b.norm()).item()

out = {}
torch.manual_seed(0)
B, H, L, D = 2, 3, 37, 40
for acc_dtype, tile_dtype in ((torch.float64, torch.float64), (torch.float32, torch.float32),
                              (torch.float32, torch.bfloat16)):
    for layout in ("contiguous", "blhd"):
        big_o = torch.randn(B, H, L + 11, D, dtype=acc_dtype)
        big_lse = torch.randn(B, H, L + 11, dtype=acc_dtype) * 3
        before = big_o.clone()
        o, lse = big_o[:, :, 5:5 + L], big_lse[:, :, 5:5 + L]
        o_t = torch.randn(B, H, L, D, dtype=tile_dtype) if layout == "contiguous" else \
            torch.randn(B, L, H, D, dtype=tile_dtype).transpose(1, 2)
        lse_t = (torch.randn(B, L, H, dtype=torch.float32) * 3).transpose(1, 2)
        ro, rl = o.clone(), lse.clone()
        at.merge_eager(ro, rl, o_t, lse_t.to(acc_dtype))
        merge_(o, lse, o_t, lse_t.to(acc_dtype))
        out[f"{acc_dtype} {tile_dtype} {layout}"] = [rel(o, ro), rel(lse, rl)]
        out[f"{acc_dtype} {tile_dtype} {layout} outside"] = bool(
            torch.equal(big_o[:, :, :5], before[:, :, :5]) and torch.equal(big_o[:, :, 5 + L:], before[:, :, 5 + L:]))

o = torch.randn(1, 1, 4, 8, dtype=torch.float64)
lse = torch.tensor([[[float("-inf"), float("-inf"), 0.5, float("-inf")]]], dtype=torch.float64)
o_t = torch.randn(1, 1, 4, 8, dtype=torch.float64)
lse_t = torch.tensor([[[float("-inf"), 1.0, float("-inf"), 2.0]]], dtype=torch.float64)
o0, ot0 = o.clone(), o_t.clone()
merge_(o, lse, o_t, lse_t)
out["inf rows"] = [bool(lse[0, 0, 0] == float("-inf")), bool((o[0, 0, 0] == 0).all()),
                   bool(lse[0, 0, 1] == 1.0), rel(o[0, 0, 1], ot0[0, 0, 1]), bool(lse[0, 0, 2] == 0.5),
                   rel(o[0, 0, 2], o0[0, 0, 2])]

# the tiled attention with the kernel as its merge vs the eager merge
torch.manual_seed(1)
S, Hq, Hk, Dh = 48, 4, 2, 16
q = torch.randn(1, Hq, S, Dh, dtype=torch.float64, requires_grad=True)
k = torch.randn(1, Hk, S, Dh, dtype=torch.float64, requires_grad=True)
v = torch.randn(1, Hk, S, Dh, dtype=torch.float64, requires_grad=True)
cu = torch.tensor([0, 13, 30, 48])
tiles = at.pack_diagonals(at.plan_tiles(1, S, 0, S, cu, 8), 8)
do = torch.randn(1, Hq, S, Dh, dtype=torch.float64)
results, calls = [], []
for merge in (at.merge_eager, merge_):
    at.tile_merge = lambda q, merge=merge: lambda *a: (calls.append(merge.__name__), merge(*a))
    y = at.tiled_attention(q, k, v, tiles, Dh ** -0.5)
    results.append([y.detach()] + list(torch.autograd.grad(y, (q, k, v), do)))
out["tiled"] = [rel(a, b) for a, b in zip(results[1], results[0])]
out["merges"] = [calls.count("merge_eager"), calls.count("merge_")]
print(out)
"""


def test_merge_kernel_against_the_eager_merge():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    out = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    print(out)
    for key, value in out.items():
        if key.endswith("outside"):
            assert value, key  # the slice's neighbours in the buffer untouched
        elif key.startswith("torch.float64"):
            assert max(value) < 1e-14, (key, value)
        elif key.startswith("torch.float32"):
            assert max(value) < 1e-6, (key, value)
    assert out["inf rows"][:3] == [True, True, True] and out["inf rows"][4] is True, out["inf rows"]
    assert out["inf rows"][3] < 1e-15 and out["inf rows"][5] < 1e-15, out["inf rows"]
    assert out["merges"][0] == out["merges"][1] > 6 and max(out["tiled"]) < 1e-13, out
