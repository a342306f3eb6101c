"""cp_linear_cross_entropy on one rank: value and every gradient against F.cross_entropy on full logits,
ignored targets, bf16, memory (no [tokens, vocab] tensor), argument errors, and the trainer's `train.loss` key."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from deltacp import cp_cross_entropy, cp_linear_cross_entropy
from deltacp.distributed.launch import free_port
from deltacp.train.config import ConfigError, config_from_dict
from helpers import rel_l2

pytestmark = pytest.mark.fast

IGNORE = -100


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    dist.destroy_process_group()


def _problem(dtype, tokens=37, hidden=16, vocab=50, ignored=(0, 5, 36), bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[list(ignored)] = IGNORE
    return h, w, b, t


def _grads(loss, *tensors):
    return [g for g in torch.autograd.grad(loss, [x for x in tensors if x is not None])]


def _reference(h, w, b, t):
    """F.cross_entropy on the full logits, upcast as cp_cross_entropy does."""
    logits = F.linear(h, w, b).to(torch.promote_types(h.dtype, torch.float32))
    loss = F.cross_entropy(logits, t, ignore_index=IGNORE)
    return loss, _grads(loss, h, w, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("bias", [True, False])
def test_value_and_gradients_match_full_logits(mesh, dtype, tol, bias):
    h, w, b, t = _problem(dtype, bias=bias)
    ref, ref_grads = _reference(h, w, b, t)
    for chunk in (8, 37, 1000):  # 37 tokens: 5 chunks with a partial last one, exactly one, one larger
        loss = cp_linear_cross_entropy(h[None], w, t[None], mesh, chunk_size=chunk, lm_head_bias=b)
        assert loss.dtype == ref.dtype
        assert abs(loss.item() - ref.item()) <= tol * abs(ref.item()), (chunk, loss.item(), ref.item())
        for name, got, want in zip(("hidden", "weight", "bias"), _grads(loss, h, w, b), ref_grads):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert rel_l2(got, want) <= tol, (chunk, name, rel_l2(got, want))
    # the same as the logits path of deltacp (cp_cross_entropy)
    assert abs(cp_cross_entropy(F.linear(h, w, b)[None], t[None], mesh).item() - ref.item()) <= tol * ref.item()


def test_all_targets_ignored(mesh):
    """0 / 0 as cp_cross_entropy: value 0, every gradient 0."""
    h, w, b, t = _problem(torch.float64, tokens=20, ignored=range(20))
    loss = cp_linear_cross_entropy(h, w, t, mesh, chunk_size=8, lm_head_bias=b)
    old = cp_cross_entropy(F.linear(h, w, b), t, mesh)
    assert loss.item() == 0.0 and old.item() == 0.0
    assert all(g.abs().max().item() == 0.0 for g in _grads(loss, h, w, b))


def test_bf16_within_bf16_accuracy(mesh):
    """bf16 inputs: the chunked loss is as close to float64 math on the same bf16 numbers as the logits path."""
    h, w, b, t = _problem(torch.bfloat16, tokens=300, hidden=64, vocab=500, ignored=range(0, 300, 7))
    exact = [x.detach().double().requires_grad_() for x in (h, w, b)]
    ref, ref_grads = _reference(*exact, t)
    loss = cp_linear_cross_entropy(h, w, t, mesh, chunk_size=64, lm_head_bias=b)
    old = cp_cross_entropy(F.linear(h, w, b), t, mesh)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-2 * ref.item()
    for name, got, via_logits, want in zip(("hidden", "weight", "bias"), _grads(loss, h, w, b),
                                           _grads(old, h, w, b), ref_grads):
        assert got.dtype == torch.bfloat16
        err, err_old = rel_l2(got, want), rel_l2(via_logits, want)
        assert err <= max(2 * err_old, 1e-2), (name, err, err_old)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_no_tokens_by_vocab_tensor(mesh):
    """Every tensor made in forward + backward has at most chunk x vocab elements (tokens x vocab = 16x that):
    pass 2's [tokens, 16 columns] buffer included (a vocabulary chunk is at least 256 columns by default)."""
    tokens, vocab, chunk = 1024, 300, 64
    h, w, b, t = _problem(torch.float32, tokens=tokens, vocab=vocab, ignored=range(0, tokens, 5))
    with _LargestTensor() as probe:
        loss = cp_linear_cross_entropy(h, w, t, mesh, chunk_size=chunk, vocab_chunk_size=16, lm_head_bias=b)
        loss.backward()
    assert chunk * vocab >= probe.largest > tokens * 16, probe.largest
    with _LargestTensor() as probe:  # the probe sees full logits where they exist
        cp_cross_entropy(F.linear(h, w, b), t, mesh).backward()
    assert probe.largest == tokens * vocab


def test_num_items_in_batch_splits_the_mean(mesh):
    """Two micro-batches, each divided by the count of both (transformers' num_items_in_batch under gradient
    accumulation): values and gradients add up to the whole batch's mean; a count given as a tensor the same."""
    h, w, b, t = _problem(torch.float64, tokens=40, ignored=(0, 5, 21, 39))
    ref, ref_grads = _reference(h, w, b, t)
    n = int((t != IGNORE).sum())
    parts = [cp_linear_cross_entropy(h[rows], w, t[rows], mesh, chunk_size=8, lm_head_bias=b, num_items_in_batch=k)
             for rows, k in ((slice(0, 17), n), (slice(17, 40), torch.tensor(float(n))))]
    total = parts[0] + parts[1]
    assert abs(total.item() - ref.item()) <= 1e-12 * ref.item()
    for got, want in zip(_grads(total, h, w, b), ref_grads):
        assert rel_l2(got, want) <= 1e-12
    assert cp_linear_cross_entropy(h, w, torch.full_like(t, IGNORE), mesh, num_items_in_batch=0).item() == 0.0
    for bad in (-1, 2.5, torch.tensor([3, 4])):
        with pytest.raises(ValueError, match="num_items_in_batch must be one count"):
            cp_linear_cross_entropy(h, w, t, mesh, num_items_in_batch=bad)


def test_argument_errors(mesh):
    h, w, b, t = _problem(torch.float32)
    with pytest.raises(ValueError, match="target 50 is out of bounds for vocab 50"):
        cp_linear_cross_entropy(h, w, torch.full_like(t, 50), mesh)
    with pytest.raises(ValueError, match="target -3 is out of bounds"):
        cp_linear_cross_entropy(h, w, torch.full_like(t, -3), mesh)
    with pytest.raises(ValueError, match="share one dtype"):
        cp_linear_cross_entropy(h, w.double(), t, mesh)
    with pytest.raises(ValueError, match="37 hidden states but 36 targets"):
        cp_linear_cross_entropy(h, w, t[1:], mesh)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        cp_linear_cross_entropy(h, w, t, mesh, chunk_size=0)
    with pytest.raises(ValueError, match="vocab_chunk_size must be a positive integer"):
        cp_linear_cross_entropy(h, w, t, mesh, vocab_chunk_size=2.0)


def test_train_loss_key():
    assert config_from_dict({"train": {}}).loss == "linear_cross_entropy"
    assert config_from_dict({"train": {"loss": "cross_entropy"}}).loss == "cross_entropy"
    with pytest.raises(ConfigError, match=r"train\.loss='fused' is not supported"):
        config_from_dict({"train": {"loss": "fused"}})


def test_kernels_keyword_and_the_model_s_backend(mesh, monkeypatch):
    """`kernels` of the hidden-state functions ("auto" | "torch" | "triton", checked by name) reaches the kernel
    selection; the model-level loss and log-probabilities ask for their model's GDN backend's kernels (eager:
    "torch", triton: "triton"; "auto" for a model CP was not applied to), not the device's."""
    import transformers

    from deltacp import cp_causal_lm_loss, cp_token_logprobs, linear_token_logprobs, parallelize_cp
    from deltacp.losses import head_kernels_of
    from deltacp.ops.lm_head import kernels as K
    from helpers import tiny_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, b, t = _problem(torch.float32)
    for fn in (lambda: cp_linear_cross_entropy(h, w, t, mesh, kernels="triton"),
               lambda: linear_token_logprobs(h, w, t, kernels="triton")):
        with pytest.raises(RuntimeError, match=r"^kernels='triton' needs CUDA tensors; got logits on device 'cpu'"):
            fn()
    asked = []
    select = K.select_impl

    def spy(what, device, dtype, impl="auto"):
        asked.append(impl)
        return select(what, device, dtype, "torch" if impl == "triton" else impl)  # triton needs CUDA: run torch

    monkeypatch.setattr(K, "select_impl", spy)
    ref = cp_linear_cross_entropy(h, w, t, mesh, lm_head_bias=b)
    for kernels in ("auto", "torch", "triton"):
        asked.clear()
        assert torch.equal(cp_linear_cross_entropy(h, w, t, mesh, lm_head_bias=b, kernels=kernels), ref)
        linear_token_logprobs(h, w, t, bias=b, kernels=kernels).sum().backward()
        assert set(asked) == {kernels}, (kernels, asked)
    for fn in (lambda k: cp_linear_cross_entropy(h, w, t, mesh, kernels=k),
               lambda k: linear_token_logprobs(h, w, t, kernels=k)):
        with pytest.raises(ValueError, match=r": kernels='cuda' is not supported; expected one of \('auto', "
                                             r"'torch', 'triton'\)"):
            fn("cuda")
    hd, wd, _, td = _problem(torch.float64)
    with pytest.raises(ValueError, match=r"^cp_linear_cross_entropy: kernels='triton' takes bf16 / fp16 / fp32"):
        cp_linear_cross_entropy(hd, wd, td, mesh, kernels="triton")

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 16))
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE)], dim=1)
    plain = transformers.Qwen3_5ForCausalLM(tiny_config()).float()
    assert head_kernels_of(plain) == "auto"
    for backend, kernels in (("eager", "torch"), ("triton", "triton")):
        model = parallelize_cp(transformers.Qwen3_5ForCausalLM(tiny_config()).float(), mesh,
                               linear_attention_cp_mode="p2p", linear_attention_backend=backend)
        assert head_kernels_of(model) == kernels
    model = parallelize_cp(plain, mesh, linear_attention_cp_mode="p2p")  # eager: its forward runs on the CPU
    asked.clear()
    cp_causal_lm_loss(model, targets, mesh, input_ids=ids, use_cache=False).backward()
    assert asked and set(asked) == {"torch"}, asked
    asked.clear()
    cp_token_logprobs(model, targets, mesh, input_ids=ids, use_cache=False).sum().backward()
    assert asked and set(asked) == {"torch"}, asked
