"""The fused attention tile kernels on the GPU (parallel/attention_tiles.py), bf16 against float32 per-document
SDPA (helpers.per_document_attention), outputs and the gradients of q, k, v:

- cuDNN tiles (the table's choice for fixed-shape tiles of 8K and more on a capability 9.0 device; forced on
  small tiles too), K/V gathered in the all-gather's layout, 2 KV heads read unexpanded by 8 query heads;
- packed rows through varlen flash, 10 and 1,000 documents (Ulysses' whole row, and a balanced CP rank's two
  pieces with visible tiles for documents that began earlier);
- under torch.use_deterministic_algorithms(True): flash only, and two runs bit for bit equal.
Bounds: rel-L2 < 1e-2 (bf16 against fp32; measured figures printed).
"""

import os

import pytest
import torch

from deltacp.parallel.attention import causal_document_attention
from deltacp.parallel.attention_tiles import choose_kernel, plan_span_tiles, tiled_attention
from deltacp.parallel.documents import AttentionDocuments
from deltacp.parallel.placement import Pieces
from helpers import per_document_attention, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN / flash attention)")

H, HK, D = 8, 2, 256  # Qwen3.5's full attention
TOL = 1e-2


def _gathered(S, seed):
    """q [1, H, S, D] and kv [1, S, HK, 2D]: K | V as the all-gather leaves them."""
    torch.manual_seed(seed)
    return torch.randn(1, H, S, D, device="cuda"), torch.randn(1, S, HK, 2 * D, device="cuda")


def _compare(name, fn, q, kv, rows, cu):
    """fn(q, k, v) in bf16 against the fp32 per-document reference on the query positions `rows`; k and v are views
    of one [1, S, HK, 2D] leaf (the all-gather's layout), their gradients compared through it."""
    d_out = torch.randn(1, H, len(rows), D, device="cuda")
    results = {}
    for what, dtype, f in (("ref", torch.float32, lambda a, b, c: per_document_attention(a, b, c, cu, D ** -0.5)[
                               :, :, rows]), ("tiles", torch.bfloat16, fn)):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, kv)]
        out = f(xs[0], *xs[1].transpose(1, 2).split(D, dim=-1))
        dq, dkv = torch.autograd.grad((out.float() * d_out).sum(), xs)
        results[what] = [out.float(), dq.float(), *dkv.float().split(D, dim=-1)]
    figures = {n: rel_l2(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), results["tiles"], results["ref"])}
    print(f"\n{name}: rel-L2 vs fp32", {n: f"{x:.2e}" for n, x in figures.items()})
    assert all(x < TOL for x in figures.values()), (name, figures)


@pytest.mark.parametrize("kernel, S, q0, block", [(None, 16384, 8192, None), ("cudnn", 6144, 2048, 1000),
                                                   ("flash", 6144, 2048, 1000)])
def test_fixed_shape_tiles_match_fp32(kernel, S, q0, block):
    q, kv = _gathered(S, 0)
    tiles = plan_span_tiles(1, S, [(q0, S)], None, block)
    kernels = sorted({choose_kernel(q.bfloat16(), t, kernel) for t in tiles})
    print(f"\ncapability {torch.cuda.get_device_capability()}: tiles of {S - q0} queries run {kernels}")
    if kernel is None and torch.cuda.get_device_capability() == (9, 0):
        assert kernels == ["cudnn"], kernels  # the table's row for this device
    rows = torch.arange(q0, S, device="cuda")
    _compare(f"{kernel or 'table'} tiles", lambda a, b, c: tiled_attention(a[:, :, q0:], b, c, tiles, D ** -0.5,
                                                                          kernel=kernel),
             q, kv, rows, torch.tensor([0, S]))


def _documents(S, n):
    """n documents over S tokens, lengths from 1 up (uneven, some of one token)."""
    g = torch.Generator().manual_seed(n)
    weights = torch.rand(n, generator=g) ** 3 + 1e-3
    lengths = (weights / weights.sum() * (S - n)).floor().long() + 1
    lengths[-1] += S - int(lengths.sum())
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


@pytest.mark.parametrize("n", [10, 1000])
def test_packed_row_matches_per_document_reference(n):
    """Ulysses' per-document attention over a packed row: one varlen flash call for all the documents."""
    S = 16384
    cu = _documents(S, n)
    q, kv = _gathered(S, 1)
    docs = AttentionDocuments.build(cu)
    tiles = docs.tiles(1, S, [(0, S)], 65536)
    assert len(tiles) == 1 and choose_kernel(q.bfloat16(), tiles[0]) == "flash_varlen", tiles[:3]
    _compare(f"packed row of {n} documents", lambda a, b, c: causal_document_attention(
        a, b, c, docs, scale=D ** -0.5, dropout_p=0.0), q, kv, torch.arange(S, device="cuda"), cu)


@pytest.mark.parametrize("n", [10, 1000])
def test_packed_cp_rank_matches_per_document_reference(n):
    """A balanced CP rank (member 1 of 4: two pieces) of a packed row, 4K-token tiles: packed diagonals, visible
    tiles of documents begun in earlier blocks (flash: their shapes follow the documents)."""
    S, G, g = 16384, 4, 1
    cu = _documents(S, n)
    q, kv = _gathered(S, 2)
    pieces = Pieces(g, G, True, S // G)
    tiles = AttentionDocuments.build(cu).tiles(1, S, pieces.spans(), 4096)
    kernels = {choose_kernel(q.bfloat16(), t) for t in tiles}
    assert kernels <= {"flash", "flash_varlen"} and "flash_varlen" in kernels, kernels
    rows = pieces.row_index().cuda()
    _compare(f"balanced rank of a packed row of {n} documents",
             lambda a, b, c: tiled_attention(a[:, :, rows], b, c, tiles, D ** -0.5), q, kv, rows, cu)


def test_deterministic_switch_reproduces_bits():
    """torch.use_deterministic_algorithms(True): every tile runs flash (FA2's deterministic backward), and two
    identical fwd+bwd runs agree bit for bit, fixed-shape and packed tiles alike."""
    S = 16384
    q, kv = (x.bfloat16() for x in _gathered(S, 3))
    k, v = kv.transpose(1, 2).split(D, dim=-1)
    cu = _documents(S, 300)
    cases = {"fixed": plan_span_tiles(1, S, [(8192, S)], None, None),
             "packed": AttentionDocuments.build(cu).tiles(1, S, [(8192, S)], 4096)}
    d_out = torch.randn(1, H, S - 8192, D, device="cuda", dtype=torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        for name, tiles in cases.items():
            assert {choose_kernel(q, t) for t in tiles} <= {"flash", "flash_varlen"}, name
            runs = []
            for _ in range(2):
                xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                out = tiled_attention(xs[0][:, :, 8192:], xs[1], xs[2], tiles, D ** -0.5)
                runs.append([out, *torch.autograd.grad((out * d_out).sum(), xs)])
            same = [torch.equal(a, b) for a, b in zip(*runs)]
            print(f"\ndeterministic {name}: o, dq, dk, dv bitwise equal: {same}")
            assert all(same), (name, same)
    finally:
        torch.use_deterministic_algorithms(before)


def test_one_pass_merge_matches_the_eager_merge_and_is_faster():
    """The CUDA merge (ops/fused/attention_merge.py) against the eager ops on a ring step's shape (8K queries of 8
    heads of 256, float32 accumulator as a slice of a 16K buffer, a bf16 tile in cuDNN's [b, l, h, D] memory):
    rel-L2 < 1e-6, and its time (CUDA events, median of 20 after 5) printed beside the eager merge's, which it must
    beat (it moves 10 bytes an element where the eager ops move about 26)."""
    from deltacp.ops.fused.attention_merge import merge_
    from deltacp.parallel.attention_tiles import merge_eager

    torch.manual_seed(0)
    L = 8192
    big_o, big_lse = torch.randn(1, H, 2 * L, D, device="cuda"), torch.randn(1, H, 2 * L, device="cuda") * 3
    o_t = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse_t = torch.randn(1, H, L, device="cuda") * 3
    results, times = {}, {}
    for name, merge in (("eager", merge_eager), ("fused", merge_)):
        o, lse = big_o[:, :, L:].clone(), big_lse[:, :, L:].clone()
        merge(o, lse, o_t, lse_t)
        results[name] = (o, lse)
        samples = []
        for i in range(25):
            o, lse = big_o[:, :, L:].clone(), big_lse[:, :, L:].clone()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            merge(o, lse, o_t, lse_t)
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                samples.append(start.elapsed_time(end))
        times[name] = sorted(samples)[len(samples) // 2]
    errors = [rel_l2(a, b) for a, b in zip(results["fused"], results["eager"])]
    print(f"\nmerge of a [1, {H}, {L}, {D}] tile: eager {times['eager']:.3f} ms, one pass {times['fused']:.3f} ms; "
          f"rel-L2 o {errors[0]:.2e}, lse {errors[1]:.2e}")
    assert max(errors) < 1e-6, errors
    assert times["fused"] < times["eager"], times
