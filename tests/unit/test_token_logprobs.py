"""Per-token log-probabilities and entropy of an output head under a temperature, chunked (`linear_token_logprobs`,
`deltacp.ops.lm_head.logprobs`), on CPU, against log_softmax(F.linear(h, W, b) / T) of full float64 logits:

  - values and the gradients of sum(w * logp + u * entropy) for random per-token w, u (any upstream gradient,
    as advantages and KL terms give), bias or not, temperatures 1, 0.7, 2.5, ignored targets (logp exactly 0,
    entropy still that row's), token chunks of 1 / 8 / all / more than all, weight_grad "accumulate" and
    "two_pass" with vocabulary chunks not dividing the vocabulary, 1e-12;
  - one output's gradient only (the other unused: None upstream), frozen inputs, tied weights (the head is the
    embedding matrix), leading shapes [B, s], float32 within float32 accuracy; bf16 under random-sign weights:
    the default weight_grad="two_pass" d weight (rounded once) well within accumulate's error;
  - no [tokens, vocab] tensor in forward or backward; no gradient buffers without grad; backward twice
    (retain_graph) recomputes the same gradients; double backward raises; argument errors name the argument;
  - both Triton kernels under TRITON_INTERPRET=1 (subprocess) vs the PyTorch ones, fp32 and bf16, vocab 1000
    (the forward's online rescaling over several blocks, backward over token rows == over column chunks), and
    the whole op through them vs float64 full logits.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from deltacp import linear_token_logprobs
from deltacp.ops.lm_head.logprobs import token_logprobs
from helpers import TensorShapes, head_problem, rel_l2

pytestmark = pytest.mark.fast

IGNORE = -100
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _problem(tokens=37, hidden=12, vocab=50, dtype=torch.float64, ignored=(0, 5, 36), seed=0):
    """`head_problem` with the first and the last column as targets, and per-token upstream weights gw, gu."""
    h, w, b, t = head_problem(tokens, hidden, vocab, dtype, ignored, seed)
    t[1], t[2] = 0, vocab - 1
    g = torch.Generator().manual_seed(seed + 1)
    gw = torch.randn(tokens, generator=g, dtype=torch.float64)
    gu = torch.randn(tokens, generator=g, dtype=torch.float64)
    return h, w, b, t, gw, gu


def reference(h, w, b, t, temperature):
    """(logp, entropy) from full logits in one call: log_softmax of logits / T, gathered; -sum p log p."""
    log_p = F.log_softmax(F.linear(h, w, b) / temperature, dim=-1)
    logp = log_p.gather(-1, t.clamp(min=0)[..., None]).squeeze(-1).masked_fill(t == IGNORE, 0)
    return logp, -(log_p.exp() * log_p).sum(-1)


def _grads(fn, inputs, need, gw, gu):
    """fn(*leaves) -> (logp, ent) and the gradients of sum(gw logp + gu ent) w.r.t. the inputs flagged in need."""
    leaves = [x.clone().requires_grad_(n) if x is not None else None for x, n in zip(inputs, need)]
    logp, ent = fn(*leaves)
    wanted = [x for x in leaves if x is not None and x.requires_grad]
    grads = iter(torch.autograd.grad((gw.to(logp.dtype) * logp + gu.to(ent.dtype) * ent).sum(), wanted))
    return logp.detach(), ent.detach(), [next(grads) if x is not None and x.requires_grad else None for x in leaves]


def _compare(ours, ref, tol):
    (lp, ent, grads), (rlp, rent, rgrads) = ours, ref
    assert lp.dtype == ent.dtype == rlp.dtype
    errs = {"logp": rel_l2(lp, rlp), "entropy": rel_l2(ent, rent)}
    for name, got, want in zip(("dh", "dW", "db"), grads, rgrads):
        assert (got is None) == (want is None), name
        if want is not None:
            assert got.dtype == want.dtype and got.shape == want.shape, name
            errs[name] = rel_l2(got, want)
    assert all(v <= tol for v in errs.values()), errs
    return errs


@pytest.mark.parametrize("chunk, temperature", [(1, 1.0), (8, 0.7), (37, 2.5), (1000, 0.7)])
@pytest.mark.parametrize("mode, vchunk", [("accumulate", None), ("two_pass", 7), ("two_pass", 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_full_logits_fp64(chunk, temperature, mode, vchunk, bias):
    h, w, b, t, gw, gu = _problem(ignored=(0, 5, 36, *range(8, 16)))  # chunk 8: one chunk all ignored
    b = b if bias else None

    def ours(h, w, b):
        return linear_token_logprobs(h, w, t, bias=b, temperature=temperature, return_entropy=True,
                                     chunk_size=chunk, vocab_chunk_size=vchunk, weight_grad=mode)

    need = (True, True, bias)
    got = _grads(ours, (h, w, b), need, gw, gu)
    want = _grads(lambda h, w, b: reference(h, w, b, t, temperature), (h, w, b), need, gw, gu)
    print(_compare(got, want, 1e-12))
    ignored = t == IGNORE
    assert torch.count_nonzero(got[0][ignored]) == 0  # logp exactly 0 where ignored
    assert got[1][ignored].min() > 0 and rel_l2(got[1][ignored], want[1][ignored]) < 1e-12  # entropy everywhere


@pytest.mark.parametrize("which", ["logp", "entropy", "logp, return_entropy=False"])
def test_one_output_used(which):
    """An unused output's upstream gradient is None (not materialised as zeros): its term is left out."""
    h, w, b, t, gw, gu = _problem()
    if which == "entropy":
        gw = torch.zeros_like(gw)
    else:
        gu = torch.zeros_like(gu)

    def ours(h, w, b):
        if which == "logp, return_entropy=False":
            logp = linear_token_logprobs(h, w, t, bias=b, temperature=0.7, chunk_size=8)
            return logp, torch.zeros_like(logp)
        logp, ent = linear_token_logprobs(h, w, t, bias=b, temperature=0.7, return_entropy=True, chunk_size=8)
        return (logp, ent.detach()) if which == "logp" else (logp.detach(), ent)

    need = (True, True, True)
    got = _grads(ours, (h, w, b), need, gw, gu)
    want = _grads(lambda h, w, b: reference(h, w, b, t, 0.7), (h, w, b), need, gw, gu)
    errs = {n: rel_l2(a, c) for n, a, c in zip(("dh", "dW", "db"), got[2], want[2])}
    assert all(v <= 1e-12 for v in errs.values()), errs


@pytest.mark.parametrize("need", [(False, True, True), (True, False, False), (False, False, True),
                                  (False, True, False)],
                         ids=["hidden frozen", "weight and bias frozen", "only bias", "only weight"])
@pytest.mark.parametrize("mode", ["accumulate", "two_pass"])
def test_partial_requires_grad(need, mode):
    h, w, b, t, gw, gu = _problem()

    def ours(h, w, b):
        return linear_token_logprobs(h, w, t, bias=b, temperature=1.3, return_entropy=True, chunk_size=8,
                                     vocab_chunk_size=16, weight_grad=mode)

    _compare(_grads(ours, (h, w, b), need, gw, gu),
             _grads(lambda h, w, b: reference(h, w, b, t, 1.3), (h, w, b), need, gw, gu), 1e-12)


def test_tied_weights_and_leading_shape():
    """The head's weight is the embedding matrix E (hidden = tanh(E[ids] A)): E's gradient sums both uses;
    hidden [B, s, H] and targets [B, s] give [B, s] outputs."""
    g = torch.Generator().manual_seed(1)
    B, s, H, V = 3, 11, 8, 40
    E = torch.randn(V, H, generator=g, dtype=torch.float64)
    A = torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5
    ids = torch.randint(0, V, (B, s), generator=g)
    t = torch.randint(0, V, (B, s), generator=g)
    t[0, -1] = t[2, :3] = IGNORE
    gw, gu = torch.randn(B, s, generator=g, dtype=torch.float64), torch.randn(B, s, generator=g, dtype=torch.float64)
    results = []
    for ours in (True, False):
        e, a = E.clone().requires_grad_(), A.clone().requires_grad_()
        hidden = torch.tanh(e[ids] @ a)
        if ours:
            logp, ent = linear_token_logprobs(hidden, e, t, temperature=0.9, return_entropy=True, chunk_size=4)
        else:
            logp, ent = reference(hidden, e, None, t, 0.9)
        assert logp.shape == ent.shape == (B, s)
        results.append((logp.detach(), ent.detach(), *torch.autograd.grad((gw * logp + gu * ent).sum(), (e, a))))
    errs = [rel_l2(x, y) for x, y in zip(*results)]
    assert max(errs) < 1e-12, errs


def test_float32_within_float32_accuracy():
    h, w, b, t, gw, gu = _problem(tokens=64, hidden=32, vocab=300, ignored=range(0, 64, 7))
    f32 = [x.float() for x in (h, w, b)]

    def ours(h, w, b):
        return linear_token_logprobs(h, w, t, bias=b, temperature=0.6, return_entropy=True, chunk_size=16)

    need = (True, True, True)
    got = _grads(ours, f32, need, gw.float(), gu.float())
    assert got[0].dtype == torch.float32
    want = _grads(lambda h, w, b: reference(h, w, b, t, 0.6), (h, w, b), need, gw, gu)
    errs = {"logp": rel_l2(got[0], want[0]), "entropy": rel_l2(got[1], want[1])}
    errs.update({n: rel_l2(a, c) for n, a, c in zip(("dh", "dW", "db"), got[2], want[2])})
    print(errs)
    assert all(v < 1e-5 for v in errs.values()), errs


def test_bf16_two_pass_weight_grad_beats_running_sum():
    """bf16 under random-sign per-token weights (GRPO's +-1 advantages over the token count): the default
    weight_grad="two_pass" rounds d weight once; "accumulate" rounds a running bf16 sum once per token chunk, and
    its error grows with the chunk count (32 chunks here: well above two_pass's)."""
    g = torch.Generator().manual_seed(2)
    N, H, V = 2048, 32, 256
    h = torch.randn(N, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)
    t[::13] = IGNORE
    gw = torch.randint(0, 2, (N,), generator=g).double().mul(2).sub(1) / N
    exact = [x.double().requires_grad_() for x in (h, w)]
    ref = torch.autograd.grad((gw * reference(*exact, None, t, 0.7)[0]).sum(), exact)
    errs = {}
    for mode in ("two_pass", "accumulate"):
        leaves = [x.clone().requires_grad_() for x in (h, w)]
        logp = linear_token_logprobs(*leaves, t, temperature=0.7, chunk_size=64, weight_grad=mode)
        dh, dw = torch.autograd.grad((gw.float() * logp).sum(), leaves)
        assert dh.dtype == dw.dtype == torch.bfloat16
        errs[f"dh {mode}"], errs[f"dW {mode}"] = rel_l2(dh, ref[0]), rel_l2(dw, ref[1])
    print(errs)
    assert errs["dh two_pass"] < 5e-3 and errs["dW two_pass"] < 5e-3, errs
    assert errs["dW accumulate"] > 2 * errs["dW two_pass"], errs


@pytest.mark.parametrize("mode", ["accumulate", "two_pass"])
def test_no_tokens_by_vocab_tensor(mode):
    N, V = 40, 50
    h, w, b, t, gw, gu = _problem(tokens=N, vocab=V)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    with TensorShapes() as probe:
        logp, ent = linear_token_logprobs(*leaves[:2], t, bias=leaves[2], return_entropy=True, chunk_size=16,
                                          vocab_chunk_size=24, weight_grad=mode)
        torch.autograd.grad((gw * logp + gu * ent).sum(), leaves)
    biggest = max(torch.Size(s).numel() for s in probe.shapes)
    assert biggest < N * V, (biggest, sorted(set(probe.shapes)))


def test_no_gradient_wanted_computes_the_values_only():
    N, H, V = 40, 12, 50
    h, w, b, t, *_ = _problem(tokens=N, hidden=H, vocab=V)
    ref = reference(h, w, b, t, 0.8)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    for mode, args in (("no_grad", leaves), ("nothing requires grad", (h, w, b))):
        with TensorShapes() as probe:
            with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
                logp, ent = linear_token_logprobs(args[0], args[1], t, bias=args[2], temperature=0.8,
                                                  return_entropy=True, chunk_size=16)
        assert not logp.requires_grad and not ent.requires_grad, mode
        assert rel_l2(logp, ref[0]) < 1e-12 and rel_l2(ent, ref[1]) < 1e-12, mode
        assert not {(N, H), (V, H), (V,)} & set(probe.shapes), (mode, probe.shapes)  # no gradient buffer


def test_backward_twice_and_double_backward():
    h, w, b, t, gw, gu = _problem()
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    logp, ent = linear_token_logprobs(*leaves[:2], t, bias=leaves[2], return_entropy=True, chunk_size=8)
    total = (gw * logp + gu * ent).sum()
    first = torch.autograd.grad(total, leaves, retain_graph=True)
    second = torch.autograd.grad(total, leaves)  # recomputed from the saved inputs: the same
    assert all(torch.equal(a, c) for a, c in zip(first, second))
    logp = linear_token_logprobs(*leaves[:2], t, bias=leaves[2], chunk_size=8)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(logp.sum(), leaves[0], create_graph=True)


def test_argument_errors(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    h, w, b, t, *_ = _problem()
    fn = linear_token_logprobs
    cases = [
        (dict(target_ids=t[:-1]), "37 hidden states but 36 targets"),
        (dict(target_ids=t[None]), r"target_ids must have hidden's leading shape \(37,\), got \(1, 37\)"),
        (dict(weight=w[:, :-1]), r"weight must be \[vocab, 12\]"),
        (dict(bias=b[:-1]), r"bias must be \[50\] \(the vocabulary\)"),
        (dict(weight=w.float()), "hidden, weight and bias must share one dtype"),
        (dict(target_ids=torch.where(t == 3, 50, t)), "target 50 is out of bounds for vocab 50"),
        (dict(target_ids=torch.where(t == 3, -3, t)), "target -3 is out of bounds"),
        (dict(target_ids=t.double()), "target_ids must be an integer tensor"),
        (dict(chunk_size=0), "chunk_size must be a positive integer"),
        (dict(vocab_chunk_size=2.0), "vocab_chunk_size must be a positive integer"),
        (dict(weight_grad="fp32"), r"weight_grad='fp32'; expected one of \('two_pass', 'accumulate'\)"),
    ] + [(dict(temperature=x), "temperature must be a finite number > 0") for x in
         (0.0, -1.0, float("inf"), float("nan"), True, torch.tensor(1.0))]
    for override, match in cases:
        kwargs = dict(dict(hidden=h, weight=w, target_ids=t, bias=b), **override)
        with pytest.raises(ValueError, match=match):
            fn(**kwargs)
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(ValueError, match="weight is a DTensor .* use cp_token_logprobs"):
        fn(h, distribute_tensor(w, mesh, [Shard(0)]), t)


def test_cp_token_logprobs_checks(single_rank_group):
    """Checked on every rank before the model runs (one rank here): that CP is applied, the head's type, the
    temperature, the chunk sizes, the targets."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3_5ForCausalLM

    from deltacp import cp_token_logprobs, parallelize_cp
    from helpers import tiny_config

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    calls = []

    def model_with(head=None, cp=True):
        model = Qwen3_5ForCausalLM(tiny_config(vocab_size=9))
        if cp:
            model = parallelize_cp(model, mesh)
        if head is not None:
            model.lm_head = head
        model.forward = lambda *a, **k: calls.append(1)  # the model must not run
        return model

    t = torch.tensor([[1, 2, IGNORE]])
    with pytest.raises(ValueError, match="cp_token_logprobs: context parallelism is not applied"):
        cp_token_logprobs(model_with(cp=False), t, mesh)
    with pytest.raises(TypeError, match="cp_token_logprobs: the model's output head must be an nn.Linear"):
        cp_token_logprobs(model_with(nn.Identity()), t, mesh)
    for kwargs, match in ((dict(temperature=0), "temperature must be a finite number > 0"),
                          (dict(chunk_size=-1), "chunk_size must be a positive integer"),
                          (dict(target_ids=torch.tensor([[1, 9, 2]])), "target 9 is out of bounds for vocab 9")):
        with pytest.raises(ValueError, match=match):
            cp_token_logprobs(model_with(), kwargs.pop("target_ids", t), mesh, **kwargs)
    assert not calls


_TRITON_CODE = r"""
import torch
from deltacp.ops.fused import token_logprobs as K
from deltacp.ops.lm_head import kernels as LK
from deltacp.ops.lm_head.logprobs import token_logprobs

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()

g = torch.Generator().manual_seed(0)
n, V, T = 8, 1000, 0.7  # 1000: not a multiple of the blocks, partial last blocks
worst = {}
for dt, max_block, cols_block in ((torch.float32, 16384, 2048), (torch.bfloat16, 256, 128)):
    K.MAX_BLOCK, K.COLS_BLOCK = max_block, cols_block  # bf16: 4 forward steps a row (the online rescaling)
    x = (torch.randn(n, V, generator=g) * 4).to(dt)
    x[3, 900] = 30.0  # a row whose maximum sits in its last block
    t = torch.randint(1, V - 1, (n,), generator=g)
    t[2], t[4], t[5], t[7] = -100, V - 1, 0, -100  # ignored rows, the first and the last column
    # forward: lse, logp, entropy; the logits untouched
    out = {k: torch.empty(n) for k in ("lse", "logp", "ent", "lse_r", "logp_r", "ent_r")}
    x0 = x.clone()
    K.lp_rows_(x, t, out["lse"], out["logp"], out["ent"], T, ignore_index=-100)
    LK.lp_rows_torch_(x, t, out["lse_r"], out["logp_r"], out["ent_r"], T)
    assert torch.equal(x, x0) and torch.count_nonzero(out["logp"][[2, 7]]) == 0
    for k in ("lse", "logp", "ent"):
        worst[f"{dt} fwd {k}"] = (out[k] - out[k + "_r"]).abs().max().item()
    lse_only = torch.empty(n)
    K.lp_rows_(x, t, lse_only, torch.empty(n), None, T, ignore_index=-100)
    assert torch.equal(lse_only, out["lse"]), "no entropy: the same lse"
    # backward over token rows (col0 0) and over column chunks 300, 300, 300, 100, each term alone and both
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    for terms in ((g_lp, g_ent), (g_lp, None), (None, g_ent)):
        full_r = x.clone()
        LK.lp_grad_torch_(full_r, t, out["lse"], out["ent"], *terms, T, 0)
        full = x.clone()
        K.lp_grad_(full, t, out["lse"], out["ent"], *terms, T, 0, ignore_index=-100)
        # fp32: 1e-6 of the largest gradient; bf16: one rounding of each element (fp32 sums differing in the
        # last bits may round to neighbours) plus that
        ref, big = full_r.float(), full_r.float().abs().max().item()
        bound = 1e-6 * big + (2 ** -7 * ref.abs() if dt == torch.bfloat16 else 0)
        key = f"{dt} bwd {'lp' if terms[0] is not None else ''}{'ent' if terms[1] is not None else ''}"
        worst[key] = ((full.float() - ref).abs() / bound).max().item()
        for col0 in range(0, V, 300):
            cols = slice(col0, min(col0 + 300, V))
            chunk = x[:, cols].contiguous()
            K.lp_grad_(chunk, t, out["lse"], out["ent"], *terms, T, col0, ignore_index=-100)
            assert torch.equal(chunk, full[:, cols]), (dt, "column chunk vs token rows", col0)
K.MAX_BLOCK, K.COLS_BLOCK = 16384, 2048
print("forward: max abs differences; backward: max difference / bound", worst)
assert all(v < 1e-5 for k, v in worst.items() if "fwd" in k and "float32" in k), worst
assert all(v < 1e-4 for k, v in worst.items() if "fwd" in k and "bfloat16" in k), worst  # fp32 sums, bf16 inputs
assert all(v <= 1.0 for k, v in worst.items() if "bwd" in k), worst

# the whole op through the Triton kernels (fp32) vs full float64 logits: 11 tokens in chunks of 4, vocabulary
# chunks of 256 (two_pass), bias, ignored rows, random upstream gradients on both outputs
h = torch.randn(11, 16, generator=g)
w = torch.randn(V, 16, generator=g) / 4
b = torch.randn(V, generator=g)
t = torch.randint(0, V, (11,), generator=g)
t[[0, 5, 10]] = -100
gw, gu = torch.randn(11, generator=g), torch.randn(11, generator=g)
for mode in ("accumulate", "two_pass"):
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    lp, ent = token_logprobs(*leaves, t, T, True, 4, vocab_chunk_size=256, weight_grad=mode, impl="triton")
    got = [lp.detach(), ent.detach()] + list(torch.autograd.grad((gw * lp + gu * ent).sum(), leaves))
    ex = [x.double().requires_grad_() for x in (h, w, b)]
    log_p = torch.log_softmax(torch.nn.functional.linear(*ex) / T, -1)
    rlp = log_p.gather(1, t.clamp(min=0)[:, None]).squeeze(1).masked_fill(t == -100, 0)
    rent = -(log_p.exp() * log_p).sum(-1)
    want = [rlp.detach(), rent.detach()] + list(torch.autograd.grad((gw * rlp + gu * rent).sum(), ex))
    worst[f"op fp32 {mode}"] = max(rel(a, c) for a, c in zip(got, want))
print("op", {k: v for k, v in worst.items() if k.startswith("op")})
assert all(v < 1e-5 for k, v in worst.items() if k.startswith("op")), worst
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 test of the "
                                           "log-probability kernels runs only where triton is (test.sh installs it)")
def test_triton_kernels_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON_CODE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
