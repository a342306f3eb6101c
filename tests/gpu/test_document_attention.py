"""Per-document causal full attention on the GPU: bf16 against a float32 per-document reference (plain causal
SDPA on each document's slice, GQA by repeated KV heads), outputs and gradients; and a long packed row whose
memory stays far below one [S, S] mask."""

import pytest
import torch
import torch.nn.functional as F

from deltacp.parallel.attention import causal_document_attention
from deltacp.parallel.documents import AttentionDocuments
from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _per_document_reference(q, k, v, cu, scale):
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        group = q.shape[1] // k.shape[1]
        kk, vv = (x[:, :, a:b].repeat_interleave(group, dim=1) for x in (k, v))
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], kk, vv, is_causal=True, scale=scale))
    return torch.cat(outs, dim=2)


def test_document_attention_matches_per_document_reference():
    torch.manual_seed(0)
    H, Hkv, D, S = 8, 2, 256, 6000  # Qwen3.5's head_dim 256, 2 KV heads
    cu = torch.tensor([0, 1, 3, 700, 2048, 2049, 4100, S])
    q, k = (torch.randn(1, h, S, D, device="cuda") for h in (H, Hkv))
    v = torch.randn(1, Hkv, S, D, device="cuda")
    do = torch.randn(1, H, S, D, device="cuda")
    scale = D ** -0.5
    grads = {}
    for name, dtype, fn in (("ref", torch.float32, lambda a, b, c: _per_document_reference(a, b, c, cu, scale)),
                            ("deltacp", torch.bfloat16, lambda a, b, c: causal_document_attention(
                                a, b, c, AttentionDocuments.build(cu), scale=scale, dropout_p=0.0))):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        out.float().backward(do)
        grads[name] = [out.float()] + [x.grad.float() for x in xs]
    figures = {n: rel_l2(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), grads["deltacp"], grads["ref"])}
    print("\ndocument attention (bf16) vs per-document reference (fp32):", {k: f"{v:.2e}" for k, v in figures.items()})
    assert all(value < 2e-2 for value in figures.values()), figures


def test_long_packed_row_needs_no_dense_mask():
    torch.manual_seed(0)
    H, Hkv, D, S = 4, 2, 256, 131072
    cu = torch.tensor([0, 5000, 70000, 70001, S])
    q = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = causal_document_attention(q, k, v, AttentionDocuments.build(cu), scale=D ** -0.5, dropout_p=0.0)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    dense_mask = S * S  # one bool [S, S] mask: 16 GiB
    print(f"\n128K packed row: {extra / 2**30:.2f} GiB above the inputs (a bool [S, S] mask alone: "
          f"{dense_mask / 2**30:.0f} GiB)")
    assert torch.isfinite(out.float()).all()
    # the output, its fp32 accumulator across tiles (2x), one 64K-token tile's copies (q, repeated K and V, its
    # output: at most 2x the output here): 5x the output, a twelfth of the mask
    assert extra < 6 * out.numel() * out.element_size(), extra
