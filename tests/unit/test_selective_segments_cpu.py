"""The selective scan's token segments (`LAUNCH[...]["HS"]`) run their scans inside a thread only in the tile layout
`kernels.seg_first()` picks for the installed Triton: its coalescing pass orders the two token axes of a tile ([HS,
J, BD] or [J, HS, BD]) one way up to 3.6 and the other way from 3.7. Compiled here for sm_90 (no GPU): chunk_out at
HS 2 in the picked layout issues almost no warp shuffles in its loop over n (its scans inside a thread), while the
other layout and HS 1 issue a round of shuffles at every scan step. A Triton that changes the order again fails here,
before a GPU times a layout that lost its point.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton", reason="triton is not installed: nothing to compile")

_CODE = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import deltacp.ops.selective.triton.kernels as K

fn = K.sel_chunk_out_kernel
sig = {p.name: "i32" for p in fn.params}
sig.update({n: "*bf16" for n in ("x", "dt", "z", "Bm", "Cm", "y")})
sig.update({n: "*fp32" for n in ("A", "Dv", "h")})
params = [p.name for p in fn.params]

def loop_shuffles(hs, seg_first):
    ce = dict(resets=None, N=16, BT=32, BD=16, HS=hs, SEG_FIRST=seg_first, USE_D=True, USE_Z=True, RESETS=False)
    for n in ce:
        sig[n] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(n),): v for n, v in ce.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 3}).asm["ptx"]
    blocks, cur = {}, None
    for line in ptx.splitlines():
        if line.startswith("$L__BB"):
            cur = line.split(":")[0]
        elif cur and re.match(r"^\s+[a-z@]", line):
            blocks.setdefault(cur, []).append(line)
    loop = max(blocks.values(), key=len)  # the loop over n
    return sum("shfl" in line for line in loop)

picked = K.seg_first()
print("FIG", loop_shuffles(1, picked), loop_shuffles(2, picked), loop_shuffles(2, not picked))
"""


def test_the_picked_layout_scans_inside_a_thread():
    run = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    one, picked, other = map(int, re.search(r"FIG (\d+) (\d+) (\d+)", run.stdout).groups())
    # Triton 3.6 / 3.9: 96 shuffles a loop at HS 1 and in the other layout, 3-5 in the picked one (the carry)
    assert picked * 8 < one and picked * 8 < other, (one, picked, other)
