"""The fused linear cross entropy that computes its gradients in the forward in two passes (`deltacp.losses`),
on CPU.

  - value, dh, dW, db vs F.cross_entropy on full float64 logits (1e-12): ignored rows, a token chunk whose rows are
    all ignored, token chunks not dividing the token count, vocabulary chunks not dividing the vocabulary,
    grad_output != 1, the scale folded in the forward == the same factor as grad_output, bias or not, frozen
    hidden / weight;
  - no gradient wanted (torch.no_grad, nothing requiring grad): the loss only, no gradient buffer made;
  - once: a second backward (retain_graph) and a double backward raise;
  - bf16: the weight gradient one fp32 sum over all tokens rounded once (closer to float64 than a running bf16
    sum over token chunks, liger-kernel's default), peak bytes above the inputs = dW + dh + pass 2's buffer
    (+ CPU temporaries), no [vocab, hidden] accumulator;
  - activation checkpointing of the decoder layers (the trainer's): the loss's two passes run once;
  - both Triton kernels under TRITON_INTERPRET=1 (subprocess) vs the PyTorch ones, fp32 and bf16, vocab 1000, and
    the whole op through them.
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

from deltacp import losses as L
from deltacp.ops.lm_head import cross_entropy as CE
from helpers import TensorShapes, head_problem

pytestmark = pytest.mark.fast

IGNORE = -100
HAS_TRITON = importlib.util.find_spec("triton") is not None


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


def _check(v, grads, rv, rgrads, tol=1e-12):
    assert v.dtype == rv.dtype and abs(v.item() - rv.item()) <= tol * abs(rv.item()), (v.item(), rv.item())
    for name, got, want in zip(("dh", "dW", "db"), grads, rgrads):
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert _rel(got, want) <= tol, (name, _rel(got, want))


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
# 50 columns: 1 per vocabulary chunk, 8 chunks (last: 1), one chunk; "accumulate" has no vocabulary chunk
@pytest.mark.parametrize("vchunk, mode", [(1, "two_pass"), (7, "two_pass"), (50, "two_pass"), (7, "accumulate")])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_in_forward_gradients_match_full_logits_fp64(chunk, vchunk, bias, scale, mode):
    # rows 8..15 all ignored: with chunk 8 one whole token chunk contributes nothing
    h, w, b, t = head_problem(ignored=(0, 5, 36, *range(8, 16)))
    t[1], t[2] = 0, 49  # the first and the last column are targets
    b = b if bias else None
    ours = lambda h, w, b, t: L.linear_cross_entropy_sum(h, w, b, t, chunk, vocab_chunk_size=vchunk,  # noqa: E731
                                                         weight_grad=mode)
    need = (True, True, bias)
    v, grads = _run(ours, h, w, b, t, scale, need)
    _check(v, grads, *_run(_full_logits, h, w, b, t, scale, need))
    assert grads[0][list(range(8, 16))].abs().max().item() == 0.0  # ignored rows: no gradient


@pytest.mark.parametrize("bias", [True, False])
def test_scale_folded_in_the_forward(bias):
    """scale=s (folded into the gradients before rounding, value s x sum) == grad_output s on the plain sum."""
    h, w, b, t = head_problem(ignored=(0, 5, 36, *range(8, 16)))
    b = b if bias else None
    s = torch.tensor(1 / 3.7, dtype=torch.float64)
    folded = lambda h, w, b, t: L.linear_cross_entropy_sum(h, w, b, t, 8, vocab_chunk_size=7, scale=s)  # noqa
    need = (True, True, bias)
    v, grads = _run(folded, h, w, b, t, 2.0, need)
    rv, rgrads = _run(_full_logits, h, w, b, t, 2.0 * s, need)
    _check(v, grads, rv * s, rgrads)


@pytest.mark.parametrize("need", [(False, True, True), (True, False, False), (False, False, True),
                                  (False, True, False)],
                         ids=["hidden frozen", "weight and bias frozen", "only bias", "only weight"])
@pytest.mark.parametrize("mode", L.WEIGHT_GRAD_MODES)
def test_partial_requires_grad(need, mode):
    h, w, b, t = head_problem()
    ours = lambda h, w, b, t: L.linear_cross_entropy_sum(h, w, b, t, 8, vocab_chunk_size=16,  # noqa: E731
                                                         weight_grad=mode)
    v, grads = _run(ours, h, w, b, t, 2.0, need)
    rv, rgrads = _run(_full_logits, h, w, b, t, 2.0, need)
    _check(v, grads, rv, rgrads)


def test_budgeted_chunk_sizes():
    """Defaults. two_pass: pass 1 from 256 MiB (vocab 248,320 in bf16: 512 tokens, fp32: 256); pass 2 from
    min(256 MiB, the hidden states' bytes), a multiple of 256 columns, at least 256. accumulate: liger-kernel's
    token chunk, the next power of two of tokens / ceil(vocab / hidden), at least 256."""
    V, bf16 = 248_320, torch.bfloat16
    two = dict(weight_grad="two_pass")
    assert L.chunk_sizes(16384, 2048, V, bf16, **two) == (512, 2048)
    assert L.chunk_sizes(16384, 4096, V, bf16, **two) == (512, 4096)
    assert L.chunk_sizes(65536, 2048, V, bf16, **two) == (512, 2048)
    assert L.chunk_sizes(65536, 4096, V, torch.float32, **two) == (256, 1024)
    assert L.chunk_sizes(2**20, 4096, V, bf16, **two) == (512, 256)  # the floor
    assert L.chunk_sizes(100, 8, V, bf16, 7, 9, **two) == (7, 9)  # given ones win
    assert [L.chunk_sizes(n, 2048, V, bf16)[0] for n in (4096, 16384, 32768, 65536)] == [256, 256, 512, 1024]
    assert L.chunk_sizes(65536, 4096, V, bf16)[0] == 2048 and L.chunk_sizes(100, 8, V, bf16, 7)[0] == 7
    # pass 2's buffer: never above the hidden states' bytes nor 256 MiB (when not at the 256-column floor)
    for n, hid in ((16384, 2048), (32768, 2048), (65536, 4096)):
        _, vc = L.chunk_sizes(n, hid, V, bf16, **two)
        assert 2 * n * vc <= min(2 * n * hid, 256 * 2**20)


def test_no_gradient_wanted_computes_the_loss_only():
    h, w, b, t = head_problem(tokens=40, hidden=12, vocab=50)
    ref = _full_logits(h, w, b, t)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    for mode, args in (("no_grad", leaves), ("nothing requires grad", (h, w, b))):
        with TensorShapes() as probe:
            if mode == "no_grad":
                with torch.no_grad():
                    v = L.linear_cross_entropy_sum(*args, t, 16, vocab_chunk_size=24)
            else:
                v = L.linear_cross_entropy_sum(*args, t, 16, vocab_chunk_size=24)
        assert not v.requires_grad and abs(v.item() - ref.item()) <= 1e-12 * ref.item(), mode
        # no d hidden [40, 12], no weight gradient [50, 12], no pass-2 buffer [40, 24], no bias gradient
        assert not {(40, 12), (50, 12), (40 * 24,), (40, 24), (50,)} & set(probe.shapes), (mode, probe.shapes)


def test_backward_once():
    h, w, b, t = head_problem()
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    v = L.linear_cross_entropy_sum(*leaves, t, 8)
    v.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same loss twice"):
        v.backward()
    v = L.linear_cross_entropy_sum(*leaves, t, 8)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(v, leaves[0], create_graph=True)


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


@pytest.mark.parametrize("vchunk", [320, None], ids=["vocab chunk 320", "budgeted vocab chunk"])
def test_peak_bytes_no_weight_accumulator(vchunk):
    """bf16 weight [V, H], N tokens: peak above the inputs = dW (2 V H) + dh (2 N H) + pass 2's [N, columns]
    buffer + small, never an fp32 [V, H] accumulator (4 V H); pass 1's buffer is gone before dW exists."""
    N, H, V, chunk = 256, 512, 4096, 128
    h, w, _, t = head_problem(tokens=N, hidden=H, vocab=V, dtype=torch.bfloat16, ignored=range(0, N, 9))
    cols = vchunk or L.chunk_sizes(N, H, V, torch.bfloat16)[1]
    buffer2 = 2 * N * cols
    # CPU only: the PyTorch kernel's fp32 copy of the buffer and its scatter / mask temporaries; lse, loss rows
    slack = 4 * N * cols + 64 * N + 4096
    peak = _peak_bytes(h, w, t, chunk, vocab_chunk_size=vchunk, weight_grad="two_pass")
    print(f"peak bytes above the inputs {peak}; dW + dh {2 * V * H + 2 * N * H}, pass 2 buffer {buffer2}")
    assert 2 * V * H + 2 * N * H + buffer2 <= peak <= 2 * V * H + 2 * N * H + buffer2 + slack < 4 * V * H, peak


def test_peak_bytes_accumulate():
    """weight_grad="accumulate": peak above the inputs = dW (2 V H, summed in place) + dh (2 N H) + the [chunk, V]
    logits buffer + small: no fp32 accumulator, no pass-2 buffer."""
    N, H, V, chunk = 256, 512, 4096, 64
    h, w, _, t = head_problem(tokens=N, hidden=H, vocab=V, dtype=torch.bfloat16, ignored=range(0, N, 9))
    buffer1 = 2 * chunk * V
    slack = 4 * chunk * V + 64 * N + 4096  # CPU only: the PyTorch kernel's fp32 copy of the chunk and temporaries
    peak = _peak_bytes(h, w, t, chunk)
    print(f"peak bytes above the inputs {peak}; dW + dh {2 * V * H + 2 * N * H}, chunk buffer {buffer1}")
    assert 2 * V * H + 2 * N * H + buffer1 <= peak <= 2 * V * H + 2 * N * H + buffer1 + slack < 4 * V * H, peak


def test_bf16_weight_grad_one_rounding_beats_running_bf16_sum():
    """bf16: dW = one fp32 sum over all tokens, rounded once; a bf16 running sum over 32-token chunks (liger's
    default accumulation) is further from float64; dh and dW both within one-rounding error, scale folded in."""
    N, H, V = 512, 32, 300
    h, w, b, t = head_problem(tokens=N, hidden=H, vocab=V, dtype=torch.bfloat16, ignored=range(0, N, 11))
    count = (t != IGNORE).sum()
    exact = [x.double().requires_grad_() for x in (h, w)]
    ref_grads = torch.autograd.grad(_full_logits(*exact, None, t) / count, exact)
    leaves = [x.clone().requires_grad_() for x in (h, w)]
    scale = 1.0 / count.float()
    dh, dw = torch.autograd.grad(L.linear_cross_entropy_sum(*leaves, None, t, 64, vocab_chunk_size=128,
                                                            weight_grad="two_pass",
                                                            scale=scale), leaves)
    # the running bf16 sum: per 32-token chunk, that chunk's exact gradient of the mean added in bf16
    d_logits = torch.softmax(F.linear(*exact).detach(), -1)
    d_logits[torch.arange(N), t.clamp(min=0)] -= 1
    d_logits[t == IGNORE] = 0
    d_logits = (d_logits / count).to(torch.bfloat16)
    running = torch.zeros(V, H, dtype=torch.bfloat16)
    for i in range(0, N, 32):
        running += (d_logits[i:i + 32].double().T @ h[i:i + 32].double()).to(torch.bfloat16)
    errs = {"dh": _rel(dh, ref_grads[0]), "dW": _rel(dw, ref_grads[1]), "dW running bf16": _rel(running, ref_grads[1])}
    print(errs)
    assert dh.dtype == dw.dtype == torch.bfloat16
    assert errs["dh"] < 1e-2 and errs["dW"] < 1e-2 and errs["dW"] < errs["dW running bf16"], errs


def test_activation_checkpointing_runs_the_loss_once(single_rank_group, monkeypatch):
    from transformers import Qwen3_5ForCausalLM

    from deltacp import cp_causal_lm_loss, parallelize_qwen3_5_cp, shard_batch_for_cp
    from deltacp.models.checkpointing import apply_activation_checkpointing
    from helpers import cp_mesh, flat, grads_of, tiny_config

    calls = []
    real = CE._linear_ce_two_pass
    monkeypatch.setattr(CE, "_linear_ce_two_pass",
                        lambda *a, **k: (calls.append(k["need_weight"]), real(*a, **k))[1])
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
        assert calls == [True], (ac, calls)  # one two-pass run, with gradients, in the forward only
        results.append((loss.item(), flat(grads_of(model))))
    assert results[0][0] == results[1][0] and _rel(results[1][1], results[0][1]) < 1e-6


_TRITON_CODE = r"""
import sys, torch
from deltacp import losses as L
from deltacp.ops.fused import linear_ce as K
from deltacp.ops.lm_head import kernels as LK

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()

g = torch.Generator().manual_seed(0)
n, V = 8, 1000  # 1000: not a multiple of the blocks, partial last blocks
scale = torch.tensor(0.37)
worst = {}
for dt, max_block, cols_block in ((torch.float32, 16384, 2048), (torch.bfloat16, 256, 128)):
    K.MAX_BLOCK, K.COLS_BLOCK = max_block, cols_block  # bf16: 4 pass-1 steps a row, 3 pass-2 programs a row
    x = (torch.randn(n, V, generator=g) * 4).to(dt)
    t = torch.randint(1, V - 1, (n,), generator=g)
    t[2], t[4], t[5], t[7] = -100, V - 1, 0, -100  # ignored rows, the first and the last column
    ulp = 1e-6 if dt == torch.float32 else 2 ** -9  # one bf16 rounding step of values in [-0.37, 0.37]
    # pass 1
    ours, ref = x.clone(), x.clone()
    lo, lr, so, sr = torch.empty(n), torch.empty(n), torch.empty(n), torch.empty(n)
    K.ce_rows_(ours, t, lo, so, scale, ignore_index=-100, compute_grad=True)
    LK.ce_rows_torch_(ref, t, lr, sr, scale, compute_grad=True)
    assert torch.equal(lo[[2, 7]], torch.zeros(2)) and torch.count_nonzero(ours[[2, 7]]) == 0
    assert (ours.float() - ref.float()).abs().max().item() <= ulp, (dt, "pass 1 grad")
    assert (so - sr).abs().max().item() <= 1e-5, (dt, "lse")
    worst[f"{dt} pass 1"] = max(rel(lo, lr), rel(so, sr), rel(ours, ref))
    lo2, so2, x2 = torch.empty(n), torch.empty(n), x.clone()
    K.ce_rows_(x2, t, lo2, so2, scale, ignore_index=-100, compute_grad=False)
    assert torch.equal(x2, x) and torch.equal(lo2, lo) and torch.equal(so2, so), (dt, "no grad: logits untouched")
    # pass 2: column chunks 300, 300, 300, 100 from pass 1's lse == pass 1's gradient (and the torch kernel)
    for col0 in range(0, V, 300):
        cols = slice(col0, min(col0 + 300, V))
        chunk = x[:, cols].contiguous()
        ref2 = chunk.clone()
        K.ce_grad_cols_(chunk, t, so, scale, col0, ignore_index=-100)
        LK.ce_grad_cols_torch_(ref2, t, so, scale, col0)
        assert torch.count_nonzero(chunk[[2, 7]]) == 0
        assert (chunk.float() - ref2.float()).abs().max().item() <= ulp, (dt, "pass 2 vs torch", col0)
        assert (chunk.float() - ours[:, cols].float()).abs().max().item() <= ulp, (dt, "pass 2 vs pass 1", col0)
        worst[f"{dt} pass 2"] = max(worst.get(f"{dt} pass 2", 0), rel(chunk, ref2))
K.MAX_BLOCK, K.COLS_BLOCK = 16384, 2048

# the whole op through the Triton kernels (fp32) vs full float64 logits: token chunks of 4 (11 tokens), vocabulary
# chunks of 256 (1000 columns: 3 x 256 + 232), bias, ignored rows, a folded scale and grad_output 3.7
h = torch.randn(11, 16, generator=g)
w = torch.randn(V, 16, generator=g) / 4
b = torch.randn(V, generator=g)
t = torch.randint(0, V, (11,), generator=g)
t[[0, 5, 10]] = -100
leaves = [x.clone().requires_grad_() for x in (h, w, b)]
v = L.linear_cross_entropy_sum(*leaves, t, 4, vocab_chunk_size=256, scale=torch.tensor(0.125), impl="triton",
                              weight_grad="two_pass")
got = [v.detach()] + list(torch.autograd.grad(v * 3.7, leaves))
ex = [x.double().requires_grad_() for x in (h, w, b)]
rv = torch.nn.functional.cross_entropy(torch.nn.functional.linear(*ex), t, ignore_index=-100, reduction="sum")
rv = rv * 0.125
want = [rv.detach()] + list(torch.autograd.grad(rv * 3.7, ex))
worst["op fp32"] = max(rel(a, b_) for a, b_ in zip(got, want))
print("worst", worst)
assert all(v < 1e-6 for k, v in worst.items() if "float32" in k), worst
assert all(v < 1e-2 for k, v in worst.items() if "bfloat16" in k), worst
assert worst["op fp32"] < 1e-5, worst
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 test of the linear "
                                           "cross-entropy kernels runs only where triton is (test.sh installs it)")
def test_triton_ce_kernels_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _TRITON_CODE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
