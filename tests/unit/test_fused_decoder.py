"""CPU (TRITON_INTERPRET=1) tests of the fused decoder glue (`deltacp.ops.fused.decoder`) and of its installation
on a model (`deltacp.models.fused_decoder`). Need triton (skipped, with the reason, where it is not installed).

Ops, against transformers' own modules and functions (Qwen3_5RMSNorm, F.silu(gate) * up, residual + x) on the same
values, and against float64:
  - float32: forward and every gradient (x, residual, weight, gate, up) within a few fp32 ulps of transformers'
    (rel-L2 < 1e-6), and the float32 error vs float64 no larger than transformers' own (x 2);
  - float64: the kernels compute in float64: vs a float64 chain, rel-L2 < 1e-13;
  - bfloat16 (weights fp32 and bf16): SwiGLU forward and backward bitwise; RMSNorm / add+RMSNorm forward and
    backward bitwise but for the fp32 sum order over the hidden dimension (a few elements in 10^4 may differ by one
    bf16 ulp: counted and bounded), the residual sum bitwise; dweight rel < 1e-5.
  Row counts (37) and element counts (1850) not multiples of any block; 3 backward programs for 37 rows (the
  per-program dweight partials). The interpreter's fp32 -> bf16 cast truncates; the test patches it to round to
  nearest even, as the GPU does.
Model: a tiny Qwen3_5ForCausalLM (2 layers, hidden 64, 1 GDN + 1 attention, float32) with the fused forwards
installed vs without: logits and every parameter gradient (rel-L2 of all gradients < 1e-6; per parameter < 1e-5,
the GDN gate gradients being the worst-conditioned: a reordered fp32 sum in the norm moves them by ~1e-6);
state_dict keys unchanged; under the trainer's activation checkpointing the same logits and gradients, bitwise;
remove_fused_decoder restores the classes' forwards (and refuses while checkpointing wraps them); importing
deltacp and the installer loads no kernel module. Qwen3.5-MoE and Qwen3-Next (tiny, float32): logits, router
logits, auxiliary loss and all gradients < 1e-6 (MLPs, dense and routed, stay transformers' own);
through deltacp's CP forwards (one rank, p2p, packed documents): logits and gradients < 1e-6, caches still refused.
`parallelize_cp` installs the glue on the Triton backend only.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: the TRITON_INTERPRET=1 tests of "
                                                         "the fused decoder glue run only where triton is")

_PRELUDE = r"""
import sys, copy, torch
import numpy as np
import torch.nn.functional as F


def patch_interpreter_bf16_round():
    # the interpreter's fp32 -> bf16 cast truncates; the GPU's (and torch's) rounds to nearest even
    import triton.language as tl
    from triton.runtime import interpreter as it
    if getattr(it.InterpreterBuilder.cast_impl, "_deltacp_patched", False):
        return
    orig = it.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return it.TensorHandle(data.view(np.uint16), tl.bfloat16)
        return orig(self, src, dst_type)

    cast_impl._deltacp_patched = True
    it.InterpreterBuilder.cast_impl = cast_impl


patch_interpreter_bf16_round()


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    n = b.norm()
    return ((a - b).norm() / n).item() if n > 0 else a.norm().item()


def ndiff(a, b):
    return int((a != b).sum())
"""

_OPS = _PRELUDE + r"""
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
import deltacp, deltacp.ops.fused, deltacp.models.fused_decoder  # noqa: E401
assert "deltacp.ops.fused.decoder" not in sys.modules, "the kernels must load only at the first fused forward"
from deltacp.ops.fused.decoder import add_rms_norm, rms_norm, swiglu

SHAPE, H, EPS = (1, 37), 100, 1e-6      # 37 rows, H not a power of two
out = {}


def ref_norm(x, w, eps=EPS):  # transformers' module, on x's dtype
    m = Qwen3_5RMSNorm(H, eps=eps)
    m._parameters["weight"] = w  # the leaf itself, so its gradient is the module's
    return m(x)


def ref_norm64(x, w, eps=EPS):  # the same chain in float64
    x, w = x.double(), w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def grads(outs, ins, gos):
    outs, gos = zip(*[(o, g) for o, g in zip(outs, gos) if g is not None])
    return torch.autograd.grad(outs, ins, gos)


gen = torch.Generator().manual_seed(0)
rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
x0, r0, w0 = rn(*SHAPE, H), rn(*SHAPE, H), rn(H) * 0.3
dy0, ds0 = rn(*SHAPE, H), rn(*SHAPE, H)
I = 50
g0, u0, dz0 = rn(*SHAPE, I) * 3, rn(*SHAPE, I), rn(*SHAPE, I)

# ---- float32 vs transformers (and both vs float64)
x, w = leaves(x0, w0)
ours = [rms_norm(x, w, EPS)]
ours += grads(ours, [x, w], [dy0])
xr, wr = leaves(x0, w0)
theirs = [ref_norm(xr, wr)]
theirs += grads(theirs, [xr, wr], [dy0])
x6, w6 = leaves(x0.double(), w0.double())
exact = [ref_norm64(x6, w6)]
exact += grads(exact, [x6, w6], [dy0.double()])
out["norm fp32"] = [rel(a, b) for a, b in zip(ours, theirs)]
out["norm fp32 vs fp64 (ours, transformers)"] = [(rel(a, c), rel(b, c)) for a, b, c in zip(ours, theirs, exact)]

x, r, w = leaves(x0, r0, w0)
y, s = add_rms_norm(x, r, w, EPS)
ours = [y, s] + list(grads([y, s], [x, r, w], [dy0, ds0]))
xr, rr, wr = leaves(x0, r0, w0)
sr = rr + xr
yr = ref_norm(sr, wr)
theirs = [yr, sr] + list(grads([yr, sr], [xr, rr, wr], [dy0, ds0]))
out["add_norm fp32"] = [rel(a, b) for a, b in zip(ours, theirs)]
for name, gy, gs in (("dy only", dy0, None), ("ds only", None, ds0)):
    x, r, w = leaves(x0, r0, w0)
    y, s = add_rms_norm(x, r, w, EPS)
    a = grads([y, s], [x, r, w], [gy, gs]) if gy is not None else list(grads([s], [x, r], [gs])) + [None]
    xr, rr, wr = leaves(x0, r0, w0)
    sr = rr + xr
    yr = ref_norm(sr, wr)
    b = grads([yr, sr], [xr, rr, wr], [gy, gs]) if gy is not None else list(grads([sr], [xr, rr], [gs])) + [None]
    out["add_norm fp32 " + name] = [rel(p, q) for p, q in zip(a, b) if q is not None]

g, u = leaves(g0, u0)
z = swiglu(g, u)
ours = [z] + list(grads([z], [g, u], [dz0]))
gr, ur = leaves(g0, u0)
zr = F.silu(gr) * ur
theirs = [zr] + list(grads([zr], [gr, ur], [dz0]))
g6, u6 = leaves(g0.double(), u0.double())
z6 = F.silu(g6) * u6
exact = [z6] + list(grads([z6], [g6, u6], [dz0.double()]))
out["swiglu fp32"] = [rel(a, b) for a, b in zip(ours, theirs)]
out["swiglu fp32 vs fp64 (ours, transformers)"] = [(rel(a, c), rel(b, c)) for a, b, c in zip(ours, theirs, exact)]

# ---- float64: computed in float64 throughout
x, r, w = leaves(x0.double(), r0.double(), w0.double())
y, s = add_rms_norm(x, r, w, EPS)
ours = [y, s] + list(grads([y, s], [x, r, w], [dy0.double(), ds0.double()]))
xr, rr, wr = leaves(x0.double(), r0.double(), w0.double())
sr = xr + rr
yr = ref_norm64(sr, wr, eps=float(torch.tensor(EPS, dtype=torch.float32)))  # eps enters the kernel as fp32
theirs = [yr, sr] + list(grads([yr, sr], [xr, rr, wr], [dy0.double(), ds0.double()]))
x, w = leaves(x0.double(), w0.double())
yy = rms_norm(x, w, EPS)
ours += [yy] + list(grads([yy], [x, w], [dy0.double()]))
xr, wr = leaves(x0.double(), w0.double())
yr = ref_norm64(xr, wr, eps=float(torch.tensor(EPS, dtype=torch.float32)))
theirs += [yr] + list(grads([yr], [xr, wr], [dy0.double()]))
g, u = leaves(g0.double(), u0.double())
z = swiglu(g, u)
ours += [z] + list(grads([z], [g, u], [dz0.double()]))
theirs += exact
assert all(t.dtype == torch.float64 for t in ours)
out["fp64"] = [rel(a, b) for a, b in zip(ours, theirs)]

# ---- bfloat16 vs the eager chain on the same values (weights fp32, and bf16 as under FSDP mixed precision)
bf = torch.bfloat16
xb, rb, dyb, dsb = (t.to(bf) for t in (x0, r0, dy0, ds0))
for wdt in (torch.float32, bf):
    wb = w0.to(wdt)
    x, r, w = leaves(xb, rb, wb)
    y, s = add_rms_norm(x, r, w, EPS)
    ours = [y, s] + list(grads([y, s], [x, r, w], [dyb, dsb]))
    xr, rr, wr = leaves(xb, rb, wb)
    sr = rr + xr
    yr = ref_norm(sr, wr)
    theirs = [yr, sr] + list(grads([yr, sr], [xr, rr, wr], [dyb, dsb]))
    assert all(a.dtype == b.dtype for a, b in zip(ours, theirs)), [(a.dtype, b.dtype) for a, b in zip(ours, theirs)]
    out["add_norm bf16 w=%s ndiff" % wdt] = [ndiff(a, b) for a, b in zip(ours, theirs)]
    out["add_norm bf16 w=%s rel" % wdt] = [rel(a, b) for a, b in zip(ours, theirs)]
    x, w = leaves(xb, wb)
    y = rms_norm(x, w, EPS)
    ours = [y] + list(grads([y], [x, w], [dyb]))
    xr, wr = leaves(xb, wb)
    yr = ref_norm(xr, wr)
    theirs = [yr] + list(grads([yr], [xr, wr], [dyb]))
    out["norm bf16 w=%s ndiff" % wdt] = [ndiff(a, b) for a, b in zip(ours, theirs)]
    out["norm bf16 w=%s rel" % wdt] = [rel(a, b) for a, b in zip(ours, theirs)]
g, u = leaves(g0.to(bf), u0.to(bf))
z = swiglu(g, u)
ours = [z] + list(grads([z], [g, u], [dz0.to(bf)]))
gr, ur = leaves(g0.to(bf), u0.to(bf))
zr = F.silu(gr) * ur
theirs = [zr] + list(grads([zr], [gr, ur], [dz0.to(bf)]))
out["swiglu bf16 ndiff"] = [ndiff(a, b) for a, b in zip(ours, theirs)]
out["swiglu bf16 rel"] = [rel(a, b) for a, b in zip(ours, theirs)]
out["numel"] = [x0.numel(), g0.numel()]
print(repr(out))
"""

_MODEL = r"""
sys.path.insert(0, {testdir!r})
import logging
import transformers
from helpers import long_memory_gates_, tiny_config
from deltacp.models.fused_decoder import fused_decoder_installed, install_fused_decoder, remove_fused_decoder

logging.basicConfig(level=logging.INFO, stream=sys.stdout)
torch.manual_seed(0)
config = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
ref = long_memory_gates_(transformers.Qwen3_5ForCausalLM(config).float())
with torch.no_grad():
    for n, p in ref.named_parameters():
        if "layernorm" in n or n.endswith("model.norm.weight"):
            p.normal_(0, 0.2)
model = copy.deepcopy(ref)
keys = list(model.state_dict())
assert install_fused_decoder(model) == 2 and fused_decoder_installed(model)
assert install_fused_decoder(model) == 2  # a second install changes nothing
assert list(model.state_dict()) == keys
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
ids = torch.randint(0, 256, (1, 29))
lf, lr = model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits
w = torch.randn_like(lr)
(lf * w).sum().backward()
(lr * w).sum().backward()
names = [n for n, _ in ref.named_parameters()]
ga = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
gb = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.parameters()]
per = {{n: rel(a, b) for n, a, b in zip(names, ga, gb)}}
flat = rel(torch.cat([g.flatten() for g in ga]), torch.cat([g.flatten() for g in gb]))
worst = max(per, key=per.get)
print("logits_rel", rel(lf, lr), "flat_grad_rel", flat, "worst", worst, per[worst])

# under the trainer's activation checkpointing (applied after CP and the glue, wrapping layer.forward): the
# recompute runs the same kernels, so logits and gradients are those of the fused model without it, bitwise
from deltacp.models.checkpointing import apply_activation_checkpointing
ac = copy.deepcopy(ref)
ac.zero_grad()
install_fused_decoder(ac)
apply_activation_checkpointing(ac)
la = ac(ids, use_cache=False).logits
(la * w).sum().backward()
assert torch.equal(la, lf), "checkpointed logits"
assert all(torch.equal(p.grad if p.grad is not None else torch.zeros_like(p), g)
           for p, g in zip(ac.parameters(), ga)), "checkpointed gradients"
try:
    remove_fused_decoder(ac)
    raise AssertionError("remove_fused_decoder must refuse a checkpoint-wrapped fused forward")
except ValueError as e:
    assert "wrapped" in str(e)

assert remove_fused_decoder(model) == 2 * 3 + 1 and not fused_decoder_installed(model)  # layer, 2 norms; final norm
assert not any("forward" in m.__dict__ for m in model.modules())

# the MoE families: norms and residuals fused, routed-expert blocks as they are (MLPs as they are);
# router logits (recorded by transformers' hooks) and the auxiliary loss unchanged
from helpers import tiny_family_model
fam = {{}}
for name in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
    fref = tiny_family_model(name, dtype=torch.float32)
    with torch.no_grad():
        for n, p in fref.named_parameters():
            if "layernorm" in n or n.endswith("model.norm.weight"):
                p.normal_(0, 0.2)
    fm = copy.deepcopy(fref)
    install_fused_decoder(fm)
    assert list(fm.state_dict()) == list(fref.state_dict())
    assert not any("forward" in layer.mlp.__dict__ for layer in fm.model.layers)  # MLPs stay transformers' own
    fids = torch.randint(0, 240, (1, 23))
    a = fm(fids, use_cache=False, output_router_logits=True)
    b = fref(fids, use_cache=False, output_router_logits=True)
    fw = torch.randn_like(b.logits)
    ((a.logits * fw).sum() + a.aux_loss).backward()
    ((b.logits * fw).sum() + b.aux_loss).backward()
    grad = lambda m: torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()  # noqa: E731
                                for p in m.parameters()])
    fam[name] = max(rel(a.logits, b.logits), rel(torch.cat(a.router_logits), torch.cat(b.router_logits)),
                    rel(a.aux_loss, b.aux_loss), rel(grad(fm), grad(fref)))
print("families", fam)

# through deltacp's CP forwards (one rank, p2p, eager GDN: the mixers parallelize_cp installs, which take the CP
# context as attention_mask and `cache=`), on packed documents: the glue installed vs not
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from deltacp import parallelize_cp, shard_batch_for_cp
from deltacp.distributed.launch import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
cp_ref = parallelize_cp(copy.deepcopy(ref), mesh, linear_attention_cp_mode="p2p")
cp_fused = parallelize_cp(copy.deepcopy(ref), mesh, linear_attention_cp_mode="p2p")
install_fused_decoder(cp_fused)
batch = shard_batch_for_cp(ids, mesh, cu_seqlens=torch.tensor([0, 5, 20, ids.shape[1]]))
kw = {{k: v for k, v in batch.items() if k != "target_ids"}}
ca, cb = cp_fused(**kw, use_cache=False).logits, cp_ref(**kw, use_cache=False).logits
ca.sum().backward()
cb.sum().backward()
cp_err = max(rel(ca, cb), rel(grad(cp_fused), grad(cp_ref)))
try:
    cp_fused(**kw, use_cache=True)
    raise AssertionError("the CP mixers must still refuse caches")
except NotImplementedError:
    pass
dist.destroy_process_group()
print("cp", cp_err)
print("RESULT", rel(lf, lr), flat, per[worst], max(max(fam.values()), cp_err))
"""


@pytest.fixture(scope="module")
def interpreter_run():
    """One interpreter process for the op and model checks (most of its time goes to importing torch,
    transformers and triton). Returns {"ops": stdout of the op checks, "model": that of the model checks}."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    testdir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _OPS + "\nprint('=== model')\n" + _MODEL.format(testdir=testdir)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    ops, model = out.stdout.split("=== model\n")
    return {"ops": ops, "model": model}


@needs_triton
def test_ops_vs_transformers_fp32_fp64_bf16(interpreter_run):
    import ast

    stdout = interpreter_run["ops"]
    out = ast.literal_eval(stdout.strip().splitlines()[-1])
    print(stdout)
    for key in ("norm fp32", "add_norm fp32", "add_norm fp32 dy only", "add_norm fp32 ds only", "swiglu fp32"):
        assert max(out[key]) < 1e-6, (key, out[key])
    for key in ("norm fp32 vs fp64 (ours, transformers)", "swiglu fp32 vs fp64 (ours, transformers)"):
        assert all(a <= 2 * b + 1e-9 for a, b in out[key]), (key, out[key])
    assert max(out["fp64"]) < 1e-13, out["fp64"]
    few = max(2, out["numel"][0] // 1000)  # elements allowed one bf16 ulp off (the fp32 sum order)
    assert out["swiglu bf16 ndiff"] == [0, 0, 0], out["swiglu bf16 ndiff"]
    for wdt in ("torch.float32", "torch.bfloat16"):
        y, s, dx, dr, dw = out[f"add_norm bf16 w={wdt} ndiff"]
        assert s == 0, "the residual sum must be torch's bf16 add bitwise"
        assert dx == dr and y <= few and dx <= few, out
        assert out[f"add_norm bf16 w={wdt} rel"][4] < 1e-5 if wdt == "torch.float32" else True, out
        y, dx, dw = out[f"norm bf16 w={wdt} ndiff"]
        assert y <= few and dx <= few, out
        rels = out[f"add_norm bf16 w={wdt} rel"] + out[f"norm bf16 w={wdt} rel"]
        assert max(rels) < 1e-2, rels


@needs_triton
def test_model_fused_vs_transformers_fp32(interpreter_run):
    stdout = interpreter_run["model"]
    print(stdout)
    assert "Installed the fused Triton decoder glue" in stdout
    logits, flat, worst, families = (float(v) for v in stdout.strip().splitlines()[-1].split()[1:])
    assert logits < 1e-6 and flat < 1e-6 and worst < 1e-5, stdout
    assert families < 1e-6, stdout



@pytest.mark.fast
def test_parallelize_cp_installs_on_the_triton_backend_only(single_rank_group, caplog):
    """No forward runs here (the Triton GDN needs CUDA or the interpreter): installation only, which loads no
    kernel (so this runs without triton too)."""
    import logging

    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from deltacp import parallelize_cp
    from deltacp.models.fused_decoder import fused_decoder_installed
    from helpers import tiny_config

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    for backend in ("eager", "triton"):
        model = transformers.Qwen3_5ForCausalLM(tiny_config()).float()
        keys = list(model.state_dict())
        with caplog.at_level(logging.INFO, logger="deltacp"):
            parallelize_cp(model, mesh, linear_attention_cp_mode="p2p", linear_attention_backend=backend)
        assert fused_decoder_installed(model) == (backend == "triton")
        assert list(model.state_dict()) == keys and all(type(p) is torch.nn.Parameter for p in model.parameters())
        layer = model.model.layers[0]
        assert ("forward" in layer.input_layernorm.__dict__) == (backend == "triton")
        assert "forward" not in layer.mlp.__dict__
    assert sum("fused Triton decoder glue" in r.getMessage() for r in caplog.records) == 1


def test_a_norm_other_than_the_family_s_is_refused():
    """The glue replaces the family's RMSNorm ((1 + w) form, `Family.norm`); another norm class is named, in a
    layer and as the final norm, before anything is installed."""
    import pytest
    import torch
    import transformers

    from deltacp.models.fused_decoder import fused_decoder_installed, install_fused_decoder
    from helpers import tiny_config

    model = transformers.Qwen3_5ForCausalLM(tiny_config()).float()
    hidden = model.config.hidden_size
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(hidden)
    with pytest.raises(NotImplementedError, match=r"decoder layer 1: post_attention_layernorm is LayerNorm, not the "
                                                  r"qwen3_5 family's Qwen3_5RMSNorm"):
        install_fused_decoder(model)
    model = transformers.Qwen3_5ForCausalLM(tiny_config()).float()
    model.model.norm = torch.nn.LayerNorm(hidden)
    with pytest.raises(NotImplementedError, match=r"final norm LayerNorm is not the qwen3_5 family's Qwen3_5RMSNorm"):
        install_fused_decoder(model)
    assert not fused_decoder_installed(model)
