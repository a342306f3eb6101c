"""Full attention under sequence_layout='balanced' on gloo, float64, against deltacp's single-device computation
(the same module on the whole row on one rank, contiguous) at 1e-8.

Rank r of P holds pieces r and 2P - 1 - r of the row cut into 2P (tests/helpers.local_slice, written apart from
deltacp's placement code). One spawn per world size runs every case: Ulysses (1-D), all_gather and ring in 1-D
and (world 4, 8) in 2-D with ulysses_degree 2; plain causal rows (B = 2), a packed row (B = 1) whose documents
cross piece boundaries, and right padding (B = 2); output, input gradient of each rank's tokens, and every
parameter gradient summed over ranks. In the same spawns (world 2, 4): the ring's kept operand copies against
copies made anew (`ring_copies_failures`).
"""

import copy

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from deltacp import FullAttentionContextParallel
from deltacp.distributed.launch import run_distributed
from deltacp.parallel import attention_tiles
from deltacp.parallel.attention import install_ulysses_attention
from deltacp.parallel.documents import AttentionDocuments, CPForwardContext, cu_seqlens_from_padding
from helpers import (cp_mesh, grads_of, local_slice, rel_l2, self_meshes, summed_grads, tiny_attention,
                     tiny_config)

TIGHT = 1e-8
S = 192  # pieces of 48 / 24 / 12 tokens at CP2 / 4 / 8
PACKED = [0, 3, 40, 41, 96, 150, 151, 190, 192]  # lengths 1 and 3; documents across pieces, one ending on a piece end
RING_S, RING_PACKED = 96, [0, 3, 40, 41, 70, 96]  # the ring copies' check


def _methods(world):
    """(method, ulysses_degree, block): Ulysses; all_gather and ring in 1-D, small tiles; 2-D with u = 2."""
    out = [("ulysses", None, None), ("all_gather", 1, None), ("ring", 1, 5)]
    if world >= 4:
        out += [("all_gather", 2, 7), ("ring", 2, None)]
    return out


def balanced_attention_worker(rank, world):
    torch.manual_seed(2)
    config = tiny_config()  # 8 query heads, 2 KV heads, head dim 16
    base = tiny_attention(config)
    rotary = Qwen3_5TextRotaryEmbedding(config)
    mesh, single = cp_mesh(), self_meshes()
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, 130:] = 0  # right padding of row 1, inside a piece

    def mine(t):
        return local_slice(t, rank, world, layout="balanced")

    failures = []
    for name, (B, cu) in {"plain": (2, None), "packed": (1, torch.tensor(PACKED)),
                          "padding": (2, cu_seqlens_from_padding(mask))}.items():
        x = torch.randn(B, S, 64, dtype=torch.float64)
        d_out = torch.randn(B, S, 64, dtype=torch.float64)
        cos, sin = rotary(x, torch.arange(S).expand(3, B, S))
        ctx = None if cu is None else CPForwardContext(attention=AttentionDocuments.build(cu))
        ref = install_ulysses_attention(copy.deepcopy(base), single.get_group())
        xr = x.clone().requires_grad_()
        out_ref, _ = ref(xr, (cos, sin), ctx)
        (out_ref * d_out).sum().backward()
        grads_ref = grads_of(ref)
        for method, u, block in _methods(world):
            style = FullAttentionContextParallel(method, ulysses_degree=u if u != world else None, block=block,
                                                 sequence_layout="balanced")
            cp = style.apply(copy.deepcopy(base), mesh)
            xl = mine(x).clone().requires_grad_()
            out, _ = cp(xl, (mine(cos), mine(sin)), ctx)
            (out * mine(d_out)).sum().backward()
            grads = summed_grads(cp)
            valid = slice(None) if name != "padding" else mine(mask).bool()
            figures = {"output": rel_l2(out[valid], mine(out_ref)[valid]),
                       "input grad": rel_l2(xl.grad, mine(xr.grad))}
            figures.update({f"grad {p}": rel_l2(grads[p], grads_ref[p]) for p in grads_ref})
            failures += [f"CP{world} {name} {method} u={u} block={block} {k}: {v:.2e}"
                         for k, v in figures.items() if not v < TIGHT]
    if world <= 4:
        failures += ring_copies_failures(rank, world)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def ring_copies_failures(rank, world) -> list[str]:
    """The ring's operand copies (`attention_tiles.OperandCopies`): each query piece's laid-out q (and in backward
    dO, o, lse) made once per call and handed to every ring step that reads it, each block's K/V once per step, with
    the results of making every copy anew, bit for bit (a packed row and plain rows, 5-token tiles so that pieces
    are read by many tiles). Mutating the key of a copy (its span left out) fails the comparison."""
    torch.manual_seed(3)
    config = tiny_config()
    base = tiny_attention(config)
    S = RING_S
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
    for name, (B, cu) in {"plain": (2, None), "packed": (1, torch.tensor(RING_PACKED))}.items():
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
        # more distinct query spans, so fewer are shared
        bound = c1["handed"] // 2 if name == "plain" else c1["handed"] - 1
        if not (c1["handed"] == c0["handed"] == c0["made"] and c1["made"] <= bound):
            failures.append(f"{name}: copies kept {c1}, made anew {c0}: expected at most {bound} made when kept")
    return failures


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.fast), 4, 8])
def test_balanced_attention_parity(world):
    run_distributed(balanced_attention_worker, world, timeout_s=900)
