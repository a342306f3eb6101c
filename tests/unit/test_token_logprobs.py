"""Per-token log-probabilities and entropy of an output head under a temperature, chunked (`linear_token_logprobs`,
`deltacp.ops.lm_head.logprobs`), on CPU, against log_softmax(F.linear(h, W, b) / T) of full float64 logits:

  - values and the gradients of sum(w * logp + u * entropy) for random per-token w, u (any upstream gradient,
    as advantages and KL terms give), bias or not, temperatures 1, 0.7, 2.5, ignored targets (logp exactly 0,
    entropy still that row's), token chunks of 1 / 8 / all / more than all, weight_grad "accumulate" and
    "two_pass" with vocabulary chunks not dividing the vocabulary, 1e-12;
  - one output's gradient only (the other unused: None upstream), frozen inputs, tied weights (the head is the
    embedding matrix), leading shapes [B, s], float32 within float32 accuracy;
  - no [tokens, vocab] tensor in forward or backward; no gradient buffers without grad; backward twice
    (retain_graph) recomputes the same gradients; double backward raises; argument errors name the argument.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from deltacp import linear_token_logprobs
from deltacp.ops.lm_head.logprobs import token_logprobs

IGNORE = -100


def _problem(tokens=37, hidden=12, vocab=50, dtype=torch.float64, ignored=(0, 5, 36), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[list(ignored)] = IGNORE
    t[1], t[2] = 0, vocab - 1  # the first and the last column are targets
    gw = torch.randn(tokens, generator=g, dtype=torch.float64)
    gu = torch.randn(tokens, generator=g, dtype=torch.float64)
    return h, w, b, t, gw, gu


def reference(h, w, b, t, temperature):
    """(logp, entropy) from full logits in one call: log_softmax of logits / T, gathered; -sum p log p."""
    log_p = F.log_softmax(F.linear(h, w, b) / temperature, dim=-1)
    logp = log_p.gather(-1, t.clamp(min=0)[..., None]).squeeze(-1).masked_fill(t == IGNORE, 0)
    return logp, -(log_p.exp() * log_p).sum(-1)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


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
    errs = {"logp": _rel(lp, rlp), "entropy": _rel(ent, rent)}
    for name, got, want in zip(("dh", "dW", "db"), grads, rgrads):
        assert (got is None) == (want is None), name
        if want is not None:
            assert got.dtype == want.dtype and got.shape == want.shape, name
            errs[name] = _rel(got, want)
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
    _compare(got, want, 1e-12)
    ignored = t == IGNORE
    assert torch.count_nonzero(got[0][ignored]) == 0  # logp exactly 0 where ignored
    assert got[1][ignored].min() > 0 and _rel(got[1][ignored], want[1][ignored]) < 1e-12  # entropy everywhere


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
    errs = {n: _rel(a, c) for n, a, c in zip(("dh", "dW", "db"), got[2], want[2])}
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
    errs = [_rel(x, y) for x, y in zip(*results)]
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
    errs = {"logp": _rel(got[0], want[0]), "entropy": _rel(got[1], want[1])}
    errs.update({n: _rel(a, c) for n, a, c in zip(("dh", "dW", "db"), got[2], want[2])})
    print(errs)
    assert all(v < 1e-5 for v in errs.values()), errs


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.shapes.append(tuple(x.shape))
        return out


@pytest.mark.parametrize("mode", ["accumulate", "two_pass"])
def test_no_tokens_by_vocab_tensor(mode):
    N, V = 40, 50
    h, w, b, t, gw, gu = _problem(tokens=N, vocab=V)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    with _Shapes() as probe:
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
        with _Shapes() as probe:
            with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
                logp, ent = linear_token_logprobs(args[0], args[1], t, bias=args[2], temperature=0.8,
                                                  return_entropy=True, chunk_size=16)
        assert not logp.requires_grad and not ent.requires_grad, mode
        assert _rel(logp, ref[0]) < 1e-12 and _rel(ent, ref[1]) < 1e-12, mode
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
    """Checked on every rank before the model runs (one rank here): the head's type, the temperature, targets."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from deltacp import cp_token_logprobs

    class Tiny(nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head = head
            self.calls = 0

        def get_output_embeddings(self):
            return self.head

        def forward(self, x):
            self.calls += 1
            raise AssertionError("the model must not run")

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    t = torch.tensor([[1, 2, IGNORE]])
    with pytest.raises(TypeError, match="cp_token_logprobs: the model's output head must be an nn.Linear"):
        cp_token_logprobs(Tiny(nn.Identity()), t, mesh, x=None)
    for kwargs, match in ((dict(temperature=0), "temperature must be a finite number > 0"),
                          (dict(chunk_size=-1), "chunk_size must be a positive integer"),
                          (dict(target_ids=torch.tensor([[1, 9, 2]])), "target 9 is out of bounds for vocab 9")):
        model = Tiny(nn.Linear(4, 9))
        with pytest.raises(ValueError, match=match):
            cp_token_logprobs(model, kwargs.pop("target_ids", t), mesh, x=None, **kwargs)
        assert model.calls == 0
