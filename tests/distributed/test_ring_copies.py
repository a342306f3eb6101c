"""The ring attention's operand copies (`attention_tiles.OperandCopies`): each query piece's laid-out q (and in
backward dO, o, lse) is made once per call and handed to every ring step that reads it, each block's K/V once per
step, and the results are those of making every copy anew, bit for bit (gloo, CP2 and CP4, float64, balanced layout,
a packed row and plain rows, 5-token tiles so that pieces are read by many tiles). Mutating the key of a copy (its
span left out) fails the comparison."""

import copy

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from deltacp import FullAttentionContextParallel
from deltacp.distributed.launch import run_distributed
from deltacp.parallel import attention_tiles
from deltacp.parallel.documents import AttentionDocuments, CPForwardContext
from helpers import cp_mesh, grads_of, local_slice, tiny_attention, tiny_config

S = 96
PACKED = [0, 3, 40, 41, 70, 96]


def ring_copies_worker(rank, world):
    torch.manual_seed(3)
    config = tiny_config()
    base = tiny_attention(config)
    rotary = Qwen3_5TextRotaryEmbedding(config)
    mesh = cp_mesh()
    counts = {"made": 0, "handed": 0}
    call = attention_tiles.OperandCopies.__call__

    def counting(self, x, rows, span, form, make):
        counts["handed"] += 1

        def counted():
            counts["made"] += 1
            return make()

        return call(self, x, rows, span, form, counted)

    failures = []
    for name, (B, cu) in {"plain": (2, None), "packed": (1, torch.tensor(PACKED))}.items():
        x = torch.randn(B, S, 64, dtype=torch.float64)
        d_out = torch.randn(B, S, 64, dtype=torch.float64)
        cos, sin = rotary(x, torch.arange(S).expand(3, B, S))
        ctx = None if cu is None else CPForwardContext(attention=AttentionDocuments.build(cu))
        results = {}
        for keep in (True, False):
            init = attention_tiles.OperandCopies.__init__
            attention_tiles.OperandCopies.__call__ = counting
            if not keep:
                attention_tiles.OperandCopies.__init__ = lambda self, keep=True, budget=None: init(self, False)
            counts.update(made=0, handed=0)
            try:
                style = FullAttentionContextParallel("ring", block=5, sequence_layout="balanced")
                cp = style.apply(copy.deepcopy(base), mesh)
                xl = local_slice(x, rank, world, layout="balanced").clone().requires_grad_()
                pieces = [local_slice(t, rank, world, layout="balanced") for t in (cos, sin, d_out)]
                out, _ = cp(xl, (pieces[0], pieces[1]), ctx)
                (out * pieces[2]).sum().backward()
            finally:
                attention_tiles.OperandCopies.__init__ = init
                attention_tiles.OperandCopies.__call__ = call
            results[keep] = (out.detach(), xl.grad, grads_of(cp), dict(counts))
        (out1, dx1, g1, c1), (out0, dx0, g0, c0) = results[True], results[False]
        if not (torch.equal(out1, out0) and torch.equal(dx1, dx0) and all(torch.equal(g1[p], g0[p]) for p in g0)):
            failures.append(f"{name}: results differ with the copies kept")
        # plain rows: every piece's tiles share their copies (at most half made); a packed row's documents give
        # more distinct query spans (seen: 196 of 360 made at CP2)
        bound = c1["handed"] // 2 if name == "plain" else c1["handed"] - 1
        if not (c1["handed"] == c0["handed"] == c0["made"] and c1["made"] <= bound):
            failures.append(f"{name}: copies kept {c1}, made anew {c0}: expected at most {bound} made when kept")
    assert not failures, f"rank {rank}: " + "; ".join(failures)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.fast), 4])
def test_ring_reuses_operand_copies_exactly(world):
    run_distributed(ring_copies_worker, world, timeout_s=600)
