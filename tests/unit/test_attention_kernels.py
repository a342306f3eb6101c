"""The fused CUDA tile kernels' choice and glue, on the CPU.

- The measured table (`attention_tiles.fused_kernel`): which kernel a tile gets by capability, head dim, kind, size,
  raggedness and the deterministic switch.
- The glue around each CUDA kernel (layouts, the log-sum-exp shapes, GQA unexpanded for cuDNN and expanded for
  varlen flash, packed offsets, forced kernels), with the torch ops replaced by float64 stand-ins that keep the
  real ops' calling conventions and refuse anything else (cuDNN: lse [b, H, l, 1], KV heads as they are; flash:
  equal head counts, lse [b, H, l]; varlen flash: [T, H, D] tokens, int32 offsets, lse [H, T]). The stand-ins
  compute one tile's share from the given o and lse, as the kernels do. tests/gpu/test_attention_kernels_gpu.py runs
  the real ops on the device.
"""

from collections import Counter

import pytest
import torch

import deltacp.parallel.attention_tiles as tiles_mod
from deltacp.parallel.attention import causal_document_attention
from deltacp.parallel.attention_tiles import (Tile, fused_kernel, pack_diagonals, plan_span_tiles, ring_attention,
                                              tiled_attention)
from deltacp.parallel.documents import AttentionDocuments
from deltacp.parallel.placement import Pieces
from helpers import per_document_attention

pytestmark = pytest.mark.fast

H100 = (9, 0)


def _tile(lq, lk, causal=False, ragged=False, packed=()):
    return Tile((0, 1), (0, lq), (0, lk), causal, ragged, packed)


@pytest.mark.parametrize("capability, head_dim, tile, deterministic, expected", [
    (H100, 256, _tile(16384, 16384, causal=True), False, "cudnn"),
    (H100, 256, _tile(8192, 65536), False, "cudnn"),
    (H100, 256, _tile(1024, 65536), False, "cudnn"),
    (H100, 256, _tile(512, 65536), False, "flash"),  # below the measured sizes
    (H100, 256, _tile(16384, 16384, causal=True), True, "flash"),  # deterministic: FA2's deterministic backward
    (H100, 256, _tile(16384, 16384, ragged=True), False, "flash"),  # shapes that follow the documents
    (H100, 128, _tile(16384, 16384), False, "cudnn"),
    (H100, 64, _tile(16384, 16384), False, "flash"),  # no row for this head dim
    ((8, 0), 256, _tile(16384, 16384), False, "flash"),  # no row for this device
    ((10, 0), 256, _tile(16384, 16384), False, "flash"),
    (H100, 256, _tile(64, 64, True, True, (0, 10, 64)), False, "flash_varlen"),
    (H100, 256, _tile(64, 64, True, True, (0, 10, 64)), True, "flash_varlen"),
])
def test_fused_kernel_table(capability, head_dim, tile, deterministic, expected):
    assert fused_kernel(capability, head_dim, tile, deterministic) == expected


def test_forced_kernel_is_checked():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="kernel='flash_cuda': expected None .* or one of \\('cudnn', 'flash'\\)"):
        tiled_attention(q, q, q, [], 1.0, kernel="flash_cuda")


# ---------------------------------------------------------------------------------------------------------------
# Stand-ins for the CUDA ops
# ---------------------------------------------------------------------------------------------------------------


def _scores(q, k, causal, scale):
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        assert s.shape[-1] == s.shape[-2], "a causal tile is square"
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _attend(q, k, v, causal, scale):
    """[b, H, l, D] against [b, Hk, m, D] (GQA by head i // (H / Hk)) -> o (q's dtype), lse [b, H, l] (float32 or
    float64), computed in float32 or float64 as the kernels accumulate."""
    dtype, ct, g = q.dtype, torch.promote_types(q.dtype, torch.float32), q.shape[1] // k.shape[1]
    q, k, v = q.to(ct), k.repeat_interleave(g, 1).to(ct), v.repeat_interleave(g, 1).to(ct)
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return ((s - lse[..., None]).exp() @ v).to(dtype), lse


def _share(do, q, k, v, o, lse, causal, scale):
    """One tile's dq, dk, dv given the merged o and lse (GQA: dk, dv summed over each KV head's query heads)."""
    dtype, ct, g = q.dtype, torch.promote_types(q.dtype, torch.float32), q.shape[1] // k.shape[1]
    do, q, o, lse = do.to(ct), q.to(ct), o.to(ct), lse.to(ct)
    kk, vv = k.repeat_interleave(g, 1).to(ct), v.repeat_interleave(g, 1).to(ct)
    p = (_scores(q, kk, causal, scale) - lse[..., None]).exp()
    ds = p * (do @ vv.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dk, dv = (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ do
    return tuple(x.to(dtype) for x in ((ds @ kk) * scale, dk.unflatten(1, (-1, g)).sum(2),
                                       dv.unflatten(1, (-1, g)).sum(2)))


class StandIns:
    def __init__(self):
        self.calls = Counter()

    def cudnn(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale):
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and q.shape[1] % k.shape[1] == 0
        self.calls["cudnn"] += 1
        o, lse = _attend(q, k, v, is_causal, scale)
        empty = torch.empty(0)
        return o, lse[..., None], empty, empty, q.shape[2], k.shape[2], empty, empty, empty

    def cudnn_backward(self, do, q, k, v, o, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                       is_causal, *, scale):
        assert attn_bias is None and lse.shape == (*q.shape[:3], 1), lse.shape
        assert (max_q, max_k) == (q.shape[2], k.shape[2])
        self.calls["cudnn_backward"] += 1
        return _share(do, q, k, v, o, lse[..., 0], is_causal, scale)

    def flash(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        assert q.shape[1] == k.shape[1] == v.shape[1], "the dense flash op takes matched heads here"
        self.calls["flash"] += 1
        o, lse = _attend(q, k, v, is_causal, scale)
        empty = torch.empty(0)
        return o, lse, empty, empty, q.shape[2], k.shape[2], empty, empty, empty

    def flash_backward(self, do, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                       scale):
        assert lse.shape == q.shape[:3]
        self.calls["flash_backward"] += 1
        return _share(do, q, k, v, o, lse, is_causal, scale)

    @staticmethod
    def _segments(cu_q, cu_k, max_q, max_k, T):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k) and int(cu_q[-1]) == T
        bounds = cu_q.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return list(zip(bounds[:-1], bounds[1:]))

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale):
        assert q.dim() == 3 and q.shape == k.shape == v.shape, "varlen flash: [T, H, D], equal head counts"
        assert is_causal
        self.calls["varlen"] += 1
        o = torch.empty_like(q)
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.promote_types(q.dtype, torch.float32))
        for a, b in self._segments(cu_q, cu_k, max_q, max_k, q.shape[0]):
            o_s, lse_s = _attend(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), True, scale)
            o[a:b], lse[:, a:b] = o_s[0].transpose(0, 1), lse_s[0]
        empty = torch.empty(0)
        return o, lse, empty, empty, empty

    def varlen_backward(self, do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused,
                        *, scale):
        assert lse.shape == (q.shape[1], q.shape[0]), "varlen lse is [H, T]"
        self.calls["varlen_backward"] += 1
        grads = [torch.empty_like(x) for x in (q, k, v)]
        for a, b in self._segments(cu_q, cu_k, max_q, max_k, q.shape[0]):
            parts = _share(*(x[a:b].transpose(0, 1)[None] for x in (do, q, k, v, o)), lse[None, :, a:b], True, scale)
            for g, part in zip(grads, parts):
                g[a:b] = part[0].transpose(0, 1)
        return tuple(grads)


@pytest.fixture
def fused(monkeypatch):
    """The fused family on the CPU, an H100-class device, the CUDA ops replaced by stand-ins, the table's sizes cut
    to the test's."""
    import torch.distributed.tensor  # noqa: F401  (its op strategies name the real ops: registered before the swap)

    ops = StandIns()
    monkeypatch.setattr(tiles_mod, "tile_kernel", lambda q: "fused")
    monkeypatch.setattr(tiles_mod, "device_capability", lambda index: H100)
    monkeypatch.setattr(tiles_mod, "CUDNN_TILES", {(H100, 8, "diagonal"): 4, (H100, 8, "visible"): 4})
    for name, fn in (("_scaled_dot_product_cudnn_attention", ops.cudnn),
                     ("_scaled_dot_product_cudnn_attention_backward", ops.cudnn_backward),
                     ("_scaled_dot_product_flash_attention", ops.flash),
                     ("_scaled_dot_product_flash_attention_backward", ops.flash_backward),
                     ("_flash_attention_forward", ops.varlen), ("_flash_attention_backward", ops.varlen_backward)):
        monkeypatch.setattr(torch.ops.aten, name, fn)
    return ops


S, H, HK, D, SCALE = 64, 4, 2, 8, 0.37
CU = torch.tensor([0, 1, 2, 3, 5, 17, 18, 30, 31, 40, 47, 50, 64])


def _inputs(seed=0):
    torch.manual_seed(seed)
    return [torch.randn(1, h, S, D, dtype=torch.float64, requires_grad=True) for h in (H, HK, HK)]


def _check(out, rows, q, k, v, cu, d_seed=1):
    ref = per_document_attention(q, k, v, cu, SCALE)[:, :, rows]
    d_out = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(d_seed))
    grads_ref = torch.autograd.grad((ref * d_out).sum(), (q, k, v))
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-12
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert (g - g_ref).abs().max() < 1e-12, name


@pytest.mark.parametrize("kernel, used", [(None, {"cudnn", "flash"}), ("cudnn", {"cudnn"}), ("flash", {"flash"})])
@pytest.mark.parametrize("balanced", [False, True])
def test_unpacked_tiles_through_each_fused_kernel(fused, kernel, used, balanced):
    """A rank's queries of an unpacked row (tiles of 3 to 6 tokens: the table sends the ones of 4 and more to cuDNN
    and the rest to flash) through the stand-ins: output and gradients at float64 precision."""
    q, k, v = _inputs()
    pieces = Pieces(2, 4, balanced, 16)
    rows = pieces.row_index()
    tiles = plan_span_tiles(1, S, pieces.spans(), None, 6 if balanced else 5)
    out = tiled_attention(q[:, :, rows], k, v, tiles, SCALE, kernel=kernel)
    _check(out, rows, q, k, v, torch.tensor([0, S]))
    assert {n for n in fused.calls if not n.endswith("backward")} == used, fused.calls
    assert fused.calls["cudnn"] == fused.calls["cudnn_backward"] and fused.calls["flash"] == fused.calls[
        "flash_backward"]


@pytest.mark.parametrize("kernel", [None, "cudnn", "flash"])
def test_packed_row_through_varlen_flash(fused, kernel):
    """A packed row: every query block's diagonals in one varlen call whatever kernel is forced; the visible tiles
    of documents that began in an earlier block are ragged (flash unless cuDNN is forced)."""
    q, k, v = _inputs()
    tiles = AttentionDocuments.build(CU).tiles(1, S, [(0, S)], 16)
    out = tiled_attention(q, k, v, tiles, SCALE, kernel=kernel)
    _check(out, torch.arange(S), q, k, v, CU)
    assert fused.calls["varlen"] == fused.calls["varlen_backward"] == sum(1 for t in tiles if t.packed) == 4
    assert fused.calls["cudnn"] == (0 if kernel != "cudnn" else sum(1 for t in tiles if not t.packed))


def test_ring_through_the_stand_ins(fused):
    """Ring attention (a loopback ring of 4 members seen from member 1, balanced) with documents: packed tiles
    re-based to the holder's keys run through varlen flash."""
    q, k, v = _inputs()
    G, g, L = 4, 1, 16
    members = [Pieces(m, G, True, L) for m in range(G)]
    blocks = [torch.stack([k[:, :, p.row_index()], v[:, :, p.row_index()]]) for p in members]

    class Loopback:  # step t brings member (g - t - 1)'s block, as the ring does
        size, rank = G, g

        def __init__(self):
            self.step = 0

        def exchange(self, t, what):
            self.step += 1
            src = (g - self.step) % G if what != "dkv" else None
            block = blocks[src] if what.startswith("kv") else t
            return type("Done", (), {"wait": lambda _: block})()

    rows = members[g].row_index()
    tiles = AttentionDocuments.build(CU).tiles(1, S, members[g].spans(), None)
    assert any(t.packed for t in tiles)
    out = ring_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], tiles, SCALE, Loopback(), balanced=True)
    ref = per_document_attention(q, k, v, CU, SCALE)[:, :, rows]
    assert (out - ref).abs().max() < 1e-12
    assert fused.calls["varlen"] > 0


def test_deterministic_setting_runs_flash_only(fused):
    """Under torch.use_deterministic_algorithms(True) no tile goes to cuDNN (its backward is not reproducible)."""
    q, k, v = _inputs()
    tiles = plan_span_tiles(1, S, [(16, 48)], None, 8)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = tiled_attention(q[:, :, 16:48], k, v, tiles, SCALE)
        _check(out, torch.arange(16, 48), q, k, v, torch.tensor([0, S]))
    finally:
        torch.use_deterministic_algorithms(before)
    assert fused.calls["cudnn"] == 0 and fused.calls["flash"] == len(tiles), fused.calls


def test_document_attention_calls_follow_tokens(fused):
    """Ulysses' per-document attention: a row of 1,000 documents runs as few calls as one of 10."""
    torch.manual_seed(0)
    S_long = 2048
    q = torch.randn(1, H, S_long, D, dtype=torch.float64)
    k, v = (torch.randn(1, HK, S_long, D, dtype=torch.float64) for _ in range(2))
    calls = {}
    for n in (10, 1000):
        fused.calls.clear()
        cu = torch.linspace(0, S_long, n + 1).round().long()
        out = causal_document_attention(q, k, v, AttentionDocuments.build(cu), scale=SCALE, dropout_p=0.0)
        assert (out - per_document_attention(q, k, v, cu, SCALE)).abs().max() < 1e-12
        calls[n] = sum(fused.calls.values())
    assert calls[1000] == calls[10] == 1, calls
