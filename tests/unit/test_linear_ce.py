"""The fused linear cross entropy that computes its gradients in the forward (`deltacp.models.loss`), on CPU.

  - value, dh, dW, db vs F.cross_entropy on full float64 logits (1e-12): ignored rows, a chunk whose rows are all
    ignored, chunk sizes not dividing the token count, grad_output != 1, bias or not, frozen hidden / weight;
  - no gradient wanted (torch.no_grad, nothing requiring grad): the loss only, no gradient buffer made;
  - once: a second backward (retain_graph) and a double backward raise;
  - the bf16 weight gradient: fp32 accumulation rounded into its own storage (bitwise the fp32 sum rounded once,
    peak bytes = the fp32 accumulator + one block, never fp32 + bf16), closer to float64 than bf16 accumulation;
  - activation checkpointing of the decoder layers (the trainer's): the loss's chunk loop runs once;
  - the Triton chunk kernel under TRITON_INTERPRET=1 (subprocess) vs the PyTorch one, fp32 and bf16, vocab 1000.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from deltacp.models import loss as L

IGNORE = -100
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _problem(tokens=37, hidden=12, vocab=50, dtype=torch.float64, ignored=(0, 5, 36), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[list(ignored)] = IGNORE
    return h, w, b, t


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def _run(fn, h, w, b, t, scale, need):
    """(value, grads of scale * value w.r.t. the inputs flagged in need, None elsewhere)."""
    leaves = [x.clone().requires_grad_(n) if x is not None else None for x, n in zip((h, w, b), need)]
    value = fn(*leaves, t)
    wanted = [x for x in leaves if x is not None and x.requires_grad]
    grads = iter(torch.autograd.grad(value * scale, wanted))
    return value, [next(grads) if x is not None and x.requires_grad else None for x in leaves]


def _full_logits(h, w, b, t):
    return F.cross_entropy(F.linear(h, w, b), t, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 1000])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_in_forward_gradients_match_full_logits_fp64(chunk, bias, scale):
    # rows 8..15 all ignored: with chunk 8 one whole chunk contributes nothing
    h, w, b, t = _problem(ignored=(0, 5, 36, *range(8, 16)))
    b = b if bias else None
    ours = lambda h, w, b, t: L.linear_cross_entropy_sum(h, w, b, t, chunk)  # noqa: E731
    need = (True, True, bias)
    v, grads = _run(ours, h, w, b, t, scale, need)
    rv, rgrads = _run(_full_logits, h, w, b, t, scale, need)
    assert v.dtype == torch.float64 and abs(v.item() - rv.item()) <= 1e-12 * abs(rv.item())
    for name, got, want in zip(("dh", "dW", "db"), grads, rgrads):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel(got, want) <= 1e-12, (name, _rel(got, want))
    assert grads[0][list(range(8, 16))].abs().max().item() == 0.0  # ignored rows: no gradient


@pytest.mark.parametrize("need", [(False, True, True), (True, False, False), (False, False, True)],
                         ids=["hidden frozen", "weight and bias frozen", "only bias"])
def test_partial_requires_grad(need):
    h, w, b, t = _problem()
    ours = lambda h, w, b, t: L.linear_cross_entropy_sum(h, w, b, t, 8)  # noqa: E731
    v, grads = _run(ours, h, w, b, t, 2.0, need)
    rv, rgrads = _run(_full_logits, h, w, b, t, 2.0, need)
    assert abs(v.item() - rv.item()) <= 1e-12 * abs(rv.item())
    for got, want in zip(grads, rgrads):
        assert (got is None) == (want is None)
        if want is not None:
            assert _rel(got, want) <= 1e-12


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


def test_no_gradient_wanted_computes_the_loss_only():
    h, w, b, t = _problem(tokens=40, hidden=12, vocab=50)
    ref = _full_logits(h, w, b, t)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    for mode, args in (("no_grad", leaves), ("nothing requires grad", (h, w, b))):
        with _Shapes() as probe:
            if mode == "no_grad":
                with torch.no_grad():
                    v = L.linear_cross_entropy_sum(*args, t, 16)
            else:
                v = L.linear_cross_entropy_sum(*args, t, 16)
        assert not v.requires_grad and abs(v.item() - ref.item()) <= 1e-12 * ref.item(), mode
        # no d hidden [40, 12], no weight accumulator [50, 12] / its halves [25, 12], no bias accumulator
        assert not {(40, 12), (50, 12), (25, 12), (50,)} & set(probe.shapes), (mode, probe.shapes)


def test_backward_once():
    h, w, b, t = _problem()
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    v = L.linear_cross_entropy_sum(*leaves, t, 8)
    v.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same loss twice"):
        v.backward()
    v = L.linear_cross_entropy_sum(*leaves, t, 8)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(v, leaves[0], create_graph=True)


@pytest.mark.parametrize("vocab", [50, 51])
def test_weight_grad_rounded_in_its_own_storage(vocab):
    """bf16 result = the fp32 accumulator rounded once (bitwise), written over the accumulator's first half."""
    h, w, b, t = _problem(tokens=64, hidden=8, vocab=vocab, dtype=torch.bfloat16, ignored=(3,))
    acc = L._WeightGrad(w, torch.float32)
    acc.BLOCK_BYTES = 3 * 8 * 4  # 3 rows a block: many blocks, a partial last one
    dlogits = torch.randn(64, vocab, dtype=torch.float64).to(torch.bfloat16)
    acc.add_(dlogits, h)
    want = (dlogits.double().T @ h.double()).float().to(torch.bfloat16)  # fp32 products of bf16 are exact
    first = acc.parts[0]
    got = acc.result()
    assert got.dtype == torch.bfloat16 and got.shape == (vocab, 8) and got.is_contiguous()
    assert got.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert first.shape[0] == 32 and first.untyped_storage().nbytes() == 4 * 32 * 8  # ceil(vocab / 2) -> mult. of 8
    assert torch.equal(got, want)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages made by ops under this mode that are alive at once (CPU byte counting: a storage
    is alive while a tensor made on it by an op here is); the storages of `inputs` are not counted."""

    def __init__(self, *inputs):
        super().__init__()
        self.refs, self.live, self.peak = {}, 0, 0
        self.inputs = {x.untyped_storage().data_ptr() for x in inputs}

    def _dead(self, key, nbytes):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                key, nbytes = st.data_ptr(), st.nbytes()
                if key in self.inputs:
                    continue
                if key not in self.refs:
                    self.refs[key] = 0
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(x, self._dead, key, nbytes)
        return out


def _peak_bytes(h, w, t, chunk, **kw):
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    with _LiveBytes(h, w, hl, wl, t) as probe:
        L.linear_cross_entropy_sum(hl, wl, None, t, chunk, **kw).backward()
    return probe.peak


def test_peak_bytes_fp32_accumulator_not_plus_bf16(monkeypatch):
    """bf16 weight [V, H]: peak = the fp32 accumulator (4 V H) + the logits chunk + dh + small, not + 2 V H; with
    grad_accum_dtype=bf16, 2 V H + the same."""
    monkeypatch.setattr(L._WeightGrad, "BLOCK_BYTES", 2**16)  # 32 MiB in use: here blocks small next to V H
    N, H, V, chunk = 256, 1024, 1024, 32
    h, w, _, t = _problem(tokens=N, hidden=H, vocab=V, dtype=torch.bfloat16, ignored=range(0, N, 9))
    transient = 2 * chunk * V + 2 * N * H  # the logits chunk + dh (bf16)
    # CPU only: the PyTorch kernel's fp32 chunk copy and exp temporary, the fp32-upcast addmm operands
    slack = 8 * chunk * V + 4 * chunk * H + 2 * 2**16
    fp32 = _peak_bytes(h, w, t, chunk)
    bf16 = _peak_bytes(h, w, t, chunk, grad_accum_dtype=torch.bfloat16)
    print(f"peak bytes above the inputs: fp32 accumulation {fp32}, bf16 accumulation {bf16}; V H = {V * H}")
    assert 4 * V * H <= fp32 <= 4 * V * H + transient + slack < 6 * V * H, fp32  # fp32 + bf16: >= 6 V H
    assert 2 * V * H <= bf16 <= 2 * V * H + transient + slack, bf16


def test_bf16_fp32_accumulation_beats_bf16_accumulation():
    h, w, b, t = _problem(tokens=512, hidden=32, vocab=300, dtype=torch.bfloat16, ignored=range(0, 512, 11))
    exact = [x.double().requires_grad_() for x in (h, w)]
    (ref,) = torch.autograd.grad(_full_logits(*exact, None, t), exact[1])
    errs = {}
    for acc in (None, torch.bfloat16):
        wl = w.clone().requires_grad_()
        (dw,) = torch.autograd.grad(L.linear_cross_entropy_sum(h, wl, None, t, 32, grad_accum_dtype=acc), wl)
        errs[acc] = _rel(dw, ref)
    assert errs[None] < 5e-3 and errs[None] < errs[torch.bfloat16], errs


def test_activation_checkpointing_runs_the_loss_once(single_rank_group, monkeypatch):
    from transformers import Qwen3_5ForCausalLM

    from deltacp import cp_causal_lm_loss, parallelize_qwen3_5_cp, shard_batch_for_cp
    from deltacp.train.trainer import apply_activation_checkpointing
    from helpers import cp_mesh, flat, grads_of, tiny_config

    calls = []
    real = L._linear_ce_chunks
    monkeypatch.setattr(L, "_linear_ce_chunks", lambda *a, **k: (calls.append(k["need_weight"]), real(*a, **k))[1])
    torch.manual_seed(0)
    base = Qwen3_5ForCausalLM(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    mesh = cp_mesh()
    ids = torch.randint(0, 256, (1, 32))
    batch = shard_batch_for_cp(ids, mesh)
    inputs = {k: v for k, v in batch.items() if k != "target_ids"}
    results = []
    for ac in (False, True):
        model = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
        if ac:
            apply_activation_checkpointing(model)
        calls.clear()
        loss = cp_causal_lm_loss(model, batch["target_ids"], mesh, chunk_size=8, **inputs, use_cache=False)
        loss.backward()
        assert calls == [True], (ac, calls)  # one chunk loop, with gradients, in the forward only
        results.append((loss.item(), flat(grads_of(model))))
    assert results[0][0] == results[1][0] and _rel(results[1][1], results[0][1]) < 1e-6


_TRITON_CODE = r"""
import sys, torch
from deltacp.models import loss as L
from deltacp.ops.fused.linear_ce import ce_rows_

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()

g = torch.Generator().manual_seed(0)
n, V = 8, 1000  # 1000: not a multiple of the block (1024), one partial block
worst = {{}}
for dt in (torch.float32, torch.bfloat16):
    x = (torch.randn(n, V, generator=g) * 4).to(dt)
    t = torch.randint(1, V - 1, (n,), generator=g)
    t[2], t[4], t[5], t[7] = -100, V - 1, 0, -100  # ignored rows, the first and the last column
    ours, ref = x.clone(), x.clone()
    lo, lr = torch.empty(n), torch.empty(n)
    ce_rows_(ours, t, lo, ignore_index=-100, compute_grad=True)
    L._ce_rows_torch_(ref, t, lr, compute_grad=True)
    assert torch.equal(lo[[2, 7]], torch.zeros(2)) and torch.count_nonzero(ours[[2, 7]]) == 0
    ulp = 1e-6 if dt == torch.float32 else 2 ** -8  # one bf16 rounding of values in [-1, 1]
    assert (ours.float() - ref.float()).abs().max().item() <= ulp, (dt, "grad")
    worst[str(dt)] = max(rel(lo, lr), rel(ours, ref))
    lo2, x2 = torch.empty(n), x.clone()
    ce_rows_(x2, t, lo2, ignore_index=-100, compute_grad=False)
    assert torch.equal(x2, x) and torch.equal(lo2, lo), (dt, "no grad: logits untouched, same loss")

# the whole op through the Triton kernel (fp32) vs full float64 logits
h = torch.randn(11, 16, generator=g)
w = torch.randn(V, 16, generator=g) / 4
b = torch.randn(V, generator=g)
t = torch.randint(0, V, (11,), generator=g)
t[[0, 5, 10]] = -100
leaves = [x.clone().requires_grad_() for x in (h, w, b)]
v = L.linear_cross_entropy_sum(*leaves, t, 4, impl="triton")
got = [v.detach()] + list(torch.autograd.grad(v * 3.7, leaves))
ex = [x.double().requires_grad_() for x in (h, w, b)]
rv = torch.nn.functional.cross_entropy(torch.nn.functional.linear(*ex), t, ignore_index=-100, reduction="sum")
want = [rv.detach()] + list(torch.autograd.grad(rv * 3.7, ex))
worst["op fp32"] = max(rel(a, b_) for a, b_ in zip(got, want))
print("worst", worst)
assert worst["torch.float32"] < 1e-6 and worst["torch.bfloat16"] < 1e-2 and worst["op fp32"] < 1e-5, worst
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 test of the linear "
                                           "cross-entropy kernel runs only where triton is (CI installs none)")
def test_triton_ce_kernel_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _TRITON_CODE.format()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
