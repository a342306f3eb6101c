"""The Triton selected attention on CUDA (`ops/selected_attention.py`, the CUDA path of the indexed attention
layers), bf16 against a float32 dense reference written here (softmax of the masked scores, the mask from the
selection's token list, which tests/distributed/test_qwen4_exp.py and test_glm5_next.py check against transformers'
indexers) on the same bf16-rounded inputs, at two shapes:
- Qwen4-Exp's attention (16 query heads, 2 KV heads, head dim 256, one tile per operand): T = 8192 tokens, blocks of
  64, 32 blocks a query (a 2048-token budget);
- GLM-5.3-Flash's absorbed MLA (64 query heads over one KV head of 512, one tensor as the keys and the values: the
  latent; the wide launches: 2 blocks of 32 heads): T = 4096, pools of 16, 128 pools a query (its 2048-token budget), the
  gradient of the shared keys / values the sum of both.
Scores drawn at random: a single row and a packed row of log-normal documents; output and the input gradients
within rel-L2 BF16_TOL = 2e-2 (bf16's unit roundoff 2^-9 ~ 2e-3, the output and inputs rounded to it), and bitwise
equal in two runs (no atomics). Then other lengths and document mixes: each kernel compiled once (no specialisation
per length).
"""

from __future__ import annotations

import pytest
import torch

from deltacp.testing.documents import cu_of, doc_lengths
from deltacp.testing.selection import random_selection
from helpers import rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the Triton selected attention); the CPU interpreter test is "
                                       "tests/unit/test_selected_attention_interpret.py")

BF16_TOL = 2e-2
# (query heads, KV heads, head dim, block, blocks a query, T, one tensor as keys and values)
SHAPES = {"qwen4-exp": (16, 2, 256, 64, 32, 8192, False), "glm-5.3-flash": (64, 1, 512, 16, 128, 4096, True)}


def _problem(T, packed, seed, shape="qwen4-exp"):
    H, KV, D, SIZE, TOP, _, shared = SHAPES[shape]
    cu = cu_of(doc_lengths(T, 1500, 1.0, seed)) if packed else torch.tensor([0, T])
    sel = random_selection(cu, 1, T, SIZE, TOP, seed, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, T, h, D, device="cuda", generator=gen).bfloat16() for h in (H, KV, KV))
    return sel, q, k, k if shared else v, torch.randn(1, T, H * D, device="cuda", generator=gen).bfloat16()


def _dense_reference(q, k, v, sel, scale):
    """float32 softmax attention under the selection's [T, T] mask (test only), GQA by repeating K/V."""
    index, valid = sel.token_index()
    _, T, H, D = q.shape
    mask = torch.zeros(1, T, T + 1, dtype=torch.bool, device="cuda").scatter_(
        -1, torch.where(valid, index, T), True)[..., :T]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf, vf = (x.repeat_interleave(H // k.shape[2], dim=1) for x in (kf, vf))
    scores = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(1, 2).reshape(1, T, H * D)


def _leaves(q, k, v, cast=lambda x: x.clone()):
    """The inputs as leaves ((q, kv) when k is v: the shared tensor's gradient is the sum of both) and (q, k, v)."""
    xs = [cast(x).requires_grad_() for x in ((q, k) if k is v else (q, k, v))]
    return xs, (xs[0], xs[1], xs[1] if k is v else xs[2])


def _run(sel, q, k, v, go):
    from deltacp.ops.selected_attention import triton_selected_attention

    xs, qkv = _leaves(q, k, v)
    out = triton_selected_attention(*qkv, sel, q.shape[-1] ** -0.5)
    return out, torch.autograd.grad(out, xs, go)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("packed", [False, True], ids=["row", "packed"])
def test_triton_matches_dense_fp32(packed, shape):
    sel, q, k, v, go = _problem(SHAPES[shape][5], packed, 3, shape)
    refs, qkv = _leaves(q, k, v, lambda x: x.float())
    ref = _dense_reference(*qkv, sel, q.shape[-1] ** -0.5)
    ref_grads = torch.autograd.grad(ref, refs, go.float())
    del qkv
    out, grads = _run(sel, q, k, v, go)
    names = ("q", "kv") if k is v else ("q", "k", "v")
    errs = {"o": rel_l2(out, ref), **{f"d{n}": rel_l2(a, b) for n, a, b in zip(names, grads, ref_grads)}}
    del ref, ref_grads
    print(f"Triton selected attention vs fp32 dense ({shape}, {'packed' if packed else 'row'}): " +
          ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert all(e < BF16_TOL for e in errs.values()), errs
    again = _run(sel, q, k, v, go)
    assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[1])), \
        "two runs differ"


def test_one_compilation_across_lengths():
    """One variant of each kernel per shape (the head dims are constexprs; nothing else in this module compiles
    others) over 5 lengths and document mixes of each."""
    from deltacp.ops import selected_attention_kernels as kernels

    for shape in SHAPES:
        for T, packed in ((8192, False), (6144, True), (4096, False), (12288, True), (5000, True)):
            _run(*_problem(T // (2 if SHAPES[shape][2] > 256 else 1), packed, T, shape))
    counts = {name: sum(len(c[0]) for c in getattr(kernels, name).device_caches.values())
              for name in ("selected_fwd_kernel", "selected_dq_kernel", "selected_dkv_kernel")}
    print(f"compiled variants per kernel over {len(SHAPES)} shapes x 5 lengths: {counts}")
    n = len(SHAPES)
    # dkv: one variant for dK and one for dV, or one for both where keys and values are one tensor (GLM's latent)
    dkv = sum(1 if SHAPES[shape][-1] else 2 for shape in SHAPES)
    assert list(counts.values()) == [n, n, dkv], counts
