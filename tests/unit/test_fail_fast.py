"""Fail-fast contract (SPEC sections 3 and 5): each bad setting is a clear error naming it and the allowed
values, raised before any collective."""

import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from deltacp import LinearAttentionContextParallel, parallelize_qwen3_5_cp
from deltacp.config import AcceleratorConfig

pytestmark = pytest.mark.fast


def test_unknown_mode_and_backend():
    with pytest.raises(ValueError, match=r"linear_attention_cp_mode='ring'.*'ulysses', 'p2p', 'all_gather'"):
        LinearAttentionContextParallel(mode="ring")
    with pytest.raises(ValueError, match=r"linear_attention_backend='auto'.*'eager', 'triton'"):
        LinearAttentionContextParallel(mode="p2p", backend="auto")


def test_all_gather_with_triton_is_not_implemented():
    with pytest.raises(NotImplementedError, match="all_gather.*no triton backend"):
        LinearAttentionContextParallel(mode="all_gather", backend="triton")


@pytest.mark.parametrize("raw, error, pattern", [
    ({"cp": 4, "tp": 2}, ValueError, r"tp=2 .*tp must be 1"),
    ({"cp": 4, "ulysses_degree": 3}, ValueError, r"ulysses_degree=3 is not supported at cp=4: .*null or a divisor "
                                                 r"of cp, one of \[1, 2, 4\]"),
    ({"cp": 4, "ulysses_degree": 2}, ValueError, r"linear_attention_cp_mode='ulysses' with train\.accelerator\."
                                                 r"ulysses_degree=2 < cp \(4\).*one of \('p2p', 'all_gather'\)"),
    ({"cp": 4, "ulysses_degree": 2, "linear_attention_cp_mode": "p2p"}, ValueError,
     r"full_attention_cp='ulysses' with train\.accelerator\.ulysses_degree=2 < cp \(4\).*\('all_gather', 'ring'\)"),
    ({"full_attention_cp": "zigzag"}, ValueError, r"train\.accelerator\.full_attention_cp='zigzag' is not supported; "
                                                  r"expected one of \('ulysses', 'all_gather', 'ring'\)"),
    ({"cp": 0}, ValueError, r"cp must be an integer >= 1"),
    ({"linear_attention_cp_mode": "ring"}, ValueError, r"linear_attention_cp_mode='ring'"),
    ({"linear_attention_backend": "cuda"}, ValueError, r"linear_attention_backend='cuda'"),
    ({"linear_attention_cp_mode": "all_gather", "linear_attention_backend": "triton"}, NotImplementedError,
     "all_gather"),
    ({"cp": 2, "sp": 2}, ValueError, r"unknown key\(s\) \['sp'\]"),
])
def test_accelerator_config_validation(raw, error, pattern):
    with pytest.raises(error, match=pattern):
        AcceleratorConfig.from_dict(raw)


def test_accelerator_config_defaults_and_world_size():
    config = AcceleratorConfig.from_dict({})
    assert (config.cp, config.tp, config.ulysses_degree) == (1, 1, None)
    assert (config.linear_attention_cp_mode, config.linear_attention_backend) == ("ulysses", "eager")
    with pytest.raises(ValueError, match=r"cp \(3\) x tp \(1\) must divide the world size \(4\)"):
        AcceleratorConfig.from_dict({"cp": 3}).validate(world_size=4)


def _tiny_model():
    from transformers import Qwen3_5ForCausalLM

    from helpers import tiny_config

    return Qwen3_5ForCausalLM(tiny_config())


def test_mesh_errors(single_rank_group):
    model = _tiny_model()
    with pytest.raises(ValueError, match=r"cp_mesh has no CP dimension.*\('dp', 'ep'\)"):
        parallelize_qwen3_5_cp(model, init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep")))
    with pytest.raises(TypeError, match="cp_mesh must be a torch DeviceMesh"):
        parallelize_qwen3_5_cp(model, "cp")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    with pytest.raises(ValueError, match=r"ulysses_degree=2 is not supported at cp=1: .*None or a divisor of cp"):
        parallelize_qwen3_5_cp(model, mesh, ulysses_degree=2)
    with pytest.raises(ValueError, match=r"full_attention_cp='zigzag' is not supported"):
        parallelize_qwen3_5_cp(model, mesh, full_attention_cp="zigzag")
    with pytest.raises(NotImplementedError, match=r"applies to transformers' .*Qwen3_5GatedDeltaNet.*got Linear"):
        LinearAttentionContextParallel().apply(torch.nn.Linear(2, 2), mesh)
    parallelize_qwen3_5_cp(model, mesh)
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_qwen3_5_cp(model, mesh)


TRITON_DEVICE_ERROR = "backend='triton' needs CUDA tensors; got hidden_states on device 'cpu'"  # the first fused op
TRITON_MISSING_ERROR = ("linear_attention_backend='triton' needs the `triton` package (>=3.6,<4), which is not "
                        "installed; pip install \"deltacp[triton]\" or use backend='eager'")


def test_triton_backend_errors_clearly_without_cuda(single_rank_group, monkeypatch):
    """backend='triton' on CPU tensors: the first forward raises the documented device error (README: "requires a
    CUDA GPU"), with triton installed or not (the device is checked first), and never runs eager instead. Without
    triton (simulated: `import triton` raises ImportError), CUDA inputs would meet the documented not-installed
    error next."""
    from deltacp.ops.gdn.eager import EagerGDNBackend
    from deltacp.ops.gdn.triton.contract_check import check_triton_contract
    from test_triton_contract import _cuda_like

    def eager_ran(*a, **kw):
        raise AssertionError("backend='triton' fell back to the eager backend")

    for op in ("chunk_gated_delta_rule", "state_summary", "initial_state_grad"):
        monkeypatch.setattr(EagerGDNBackend, op, eager_ran)
    model = parallelize_qwen3_5_cp(_tiny_model(), init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)),
                                   linear_attention_cp_mode="p2p", linear_attention_backend="triton")
    ids = torch.randint(0, 256, (1, 64))
    with pytest.raises(RuntimeError) as err:
        model(input_ids=ids, use_cache=False)
    assert type(err.value) is RuntimeError and str(err.value) == TRITON_DEVICE_ERROR

    monkeypatch.setitem(sys.modules, "triton", None)  # triton missing: every `import triton` raises ImportError
    with pytest.raises(RuntimeError) as err:
        model(input_ids=ids, use_cache=False)
    assert type(err.value) is RuntimeError and str(err.value) == TRITON_DEVICE_ERROR
    with pytest.raises(RuntimeError) as err:
        check_triton_contract(*_cuda_like())
    assert type(err.value) is RuntimeError and str(err.value) == TRITON_MISSING_ERROR
    assert isinstance(err.value.__cause__, ImportError)


_NO_TRITON_CODE = r"""
import builtins, importlib, sys

# Records, without blocking, every import statement and import_module call naming triton or a triton submodule,
# with the module that executes it; a name already in sys.modules is recorded too (torch itself imports triton
# where it is installed, so "triton in sys.modules" proves nothing about deltacp).
records = []
_import, _import_module = builtins.__import__, importlib.import_module


def is_triton(name):
    return name == "triton" or name.startswith("triton.")


def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and is_triton(name):
        records.append(((globals or {}).get("__name__", "?"), name))
    return _import(name, globals, locals, fromlist, level)


def recording_import_module(name, package=None):
    if is_triton(name):
        records.append((sys._getframe(1).f_globals.get("__name__", "?"), name))
    return _import_module(name, package)


builtins.__import__, importlib.import_module = recording_import, recording_import_module

import torch, deltacp
sys.path.insert(0, sys.argv[1])
from helpers import tiny_config
from transformers import Qwen3_5ForCausalLM
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
for mode in ("ulysses", "p2p", "all_gather"):
    model = deltacp.parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()),
                                           init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)),
                                           linear_attention_cp_mode=mode)
    model(input_ids=torch.randint(0, 256, (1, 80)), use_cache=False).logits.sum().backward()
dist.destroy_process_group()
offenders = sorted({r for r in records if r[0].split(".")[0] == "deltacp"})
kernels = sorted(m for m in sys.modules if m.startswith("deltacp.ops.gdn.triton."))
# the recorder works: an import from a deltacp module is recorded, even of a module already imported
try:
    exec("import triton.language", {"__name__": "deltacp.probe"})
except ImportError:
    pass
assert records[-1] == ("deltacp.probe", "triton.language"), records[-3:]
print("offenders", offenders)
print("kernel modules", kernels)
print("other importers", sorted({r[0] for r in records[:-1] if r[0].split(".")[0] != "deltacp"}))
"""


def test_importing_and_running_eager_never_imports_triton():
    """Importing deltacp and running every eager mode forward and backward executes no import of triton from a
    deltacp module and loads none of the Triton backend's modules; imports are recorded, not blocked."""
    import os

    from deltacp.distributed.launch import free_port

    tests_dir = os.path.dirname(os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", _NO_TRITON_CODE, tests_dir, str(free_port())],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    assert "offenders []\n" in result.stdout and "kernel modules []\n" in result.stdout, result.stdout


def test_two_d_head_and_mode_rules_name_the_settings():
    """The 2-D layout's rules (no process group needed: checked before the configuration exchange)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5GatedDeltaNet

    from deltacp.parallel.attention import check_attention_module
    from deltacp.parallel.layout import validate_cp_layout
    from helpers import tiny_config

    gdn = Qwen3_5GatedDeltaNet(tiny_config(linear_num_key_heads=2, linear_num_value_heads=6), 0)
    with pytest.raises(ValueError, match=r"ulysses_degree=4 must divide linear_num_value_heads \(6\)"):
        LinearAttentionContextParallel(mode="p2p", ulysses_degree=4).check_module(gdn, 8)
    assert LinearAttentionContextParallel(mode="p2p", ulysses_degree=2).check_module(gdn, 8)["ulysses_degree"] == 2
    with pytest.raises(ValueError, match=r"linear_attention_cp_mode='ulysses' with ulysses_degree=2 < cp \(8\)"):
        LinearAttentionContextParallel(mode="ulysses", ulysses_degree=2).check_module(gdn, 8)
    with pytest.raises(ValueError, match=r"ulysses_degree=0 is not supported"):
        LinearAttentionContextParallel(mode="p2p", ulysses_degree=0)
    attention = Qwen3_5Attention(tiny_config(num_attention_heads=6, num_key_value_heads=2), 3)
    with pytest.raises(ValueError, match=r"ulysses_degree=4 must divide num_attention_heads \(6\)"):
        check_attention_module(attention, 8, "all_gather", 4)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) divisible by the CP degree \(8\); "
                                         r"full_attention_cp='all_gather' or 'ring' has no head limit"):
        check_attention_module(attention, 8, "ulysses", 8)
    check_attention_module(attention, 8, "ring", 1)  # no head limit
    validate_cp_layout(8, None, "ulysses", "all_gather")  # 1-D: any mode with any method
    validate_cp_layout(8, 8, "p2p", "ulysses")  # u = cp: the 1-D layout, as before
    validate_cp_layout(8, 1, "all_gather", "ring")
    with pytest.raises(ValueError, match=r"ulysses_degree=3 is not supported at cp=8: .*\[1, 2, 4, 8\]"):
        validate_cp_layout(8, 3, "p2p", "ring")


def test_one_spelling_with_the_old_one_as_alias():
    """all_gather names the method for both layer kinds; 'allgather' (full attention's old spelling) is an alias
    resolved once, and the registry is where every check gets the list of names."""
    from deltacp.config import AcceleratorConfig
    from deltacp.parallel.layout import validate_cp_layout
    from deltacp.parallel.modes import ATTENTION_METHODS, LINEAR_MODES, attention_method, linear_mode

    assert attention_method("allgather") is ATTENTION_METHODS["all_gather"]
    assert linear_mode("allgather") is LINEAR_MODES["all_gather"]
    config = AcceleratorConfig.from_dict({"cp": 4, "full_attention_cp": "allgather"})
    assert config.full_attention_cp == "all_gather"
    validate_cp_layout(8, 2, "p2p", "allgather")
    with pytest.raises(ValueError, match=r"full_attention_cp='zigzag' is not supported; expected one of "
                                         r"\('ulysses', 'all_gather', 'ring'\) \(aliases: allgather = all_gather\)"):
        attention_method("zigzag")
    with pytest.raises(NotImplementedError, match=r"linear_attention_cp_mode='all_gather' has no triton backend"):
        linear_mode("all_gather", "triton")


def test_mamba2_head_rules_name_each_familys_settings():
    """A Mamba2 layer's heads (not its groups: a slice that does not hold whole groups repeats B and C) must divide a
    Ulysses split; the refusal names the family's own config field (Bamba mamba_n_heads, Nemotron-H mamba_num_heads),
    checked before the configuration exchange."""
    from helpers import tiny_bamba, tiny_nemotron_h

    bamba = next(layer.mamba for layer in tiny_bamba(torch.float32).model.layers if hasattr(layer, "mamba"))
    nemotron = next(layer.mixer for layer in tiny_nemotron_h(torch.float32).model.layers
                    if type(layer.mixer).__name__ == "NemotronHMamba2Mixer")
    for mixer, setting in ((bamba, "mamba_n_heads"), (nemotron, "mamba_num_heads")):
        with pytest.raises(ValueError, match=rf"linear_attention_cp_mode='ulysses' needs {setting} \(8\) divisible "
                                             rf"by the CP degree \(16\)"):
            LinearAttentionContextParallel(mode="ulysses").check_module(mixer, 16)
        with pytest.raises(ValueError, match=rf"ulysses_degree=16 must divide {setting} \(8\)"):
            LinearAttentionContextParallel(mode="p2p", ulysses_degree=16).check_module(mixer, 32)
        assert LinearAttentionContextParallel(mode="ulysses").check_module(mixer, 4)["num_k_heads"] == 2  # groups


def test_mamba1_channel_split_rules_name_each_familys_settings():
    """Mamba1's channels are its heads under Ulysses and the 2-D layout: a degree that does not divide I is refused
    naming the family's config fields, before the configuration exchange; one that does is taken (the parity of the
    split: the conformance tables and tests/distributed/test_family_parity.py)."""
    from helpers import tiny_jamba, tiny_mamba

    mamba = tiny_mamba(torch.float32).backbone.layers[0].mixer
    jamba = next(layer.mamba for layer in tiny_jamba(torch.float32).model.layers if hasattr(layer, "mamba"))
    mamba_setting = r"intermediate_size \(expand x hidden_size\)"
    for mixer, setting in ((mamba, mamba_setting), (jamba, "mamba_expand x hidden_size")):
        with pytest.raises(ValueError, match=rf"linear_attention_cp_mode='ulysses' needs {setting} \(32\) divisible "
                                             rf"by the CP degree \(3\)"):
            LinearAttentionContextParallel(mode="ulysses").check_module(mixer, 3)
        with pytest.raises(ValueError, match=rf"ulysses_degree=3 must divide {setting} \(32\)"):
            LinearAttentionContextParallel(mode="p2p", ulysses_degree=3).check_module(mixer, 6)
        config = LinearAttentionContextParallel(mode="ulysses").check_module(mixer, 8)
        assert (config["num_v_heads"], config["head_k_dim"], config["head_v_dim"]) == (32, 4, 1)  # a head a channel


def test_z_loss_is_refused_by_the_cp_losses(single_rank_group):
    """Bamba's z_loss_coefficient > 0 adds a z-loss to transformers' own loss; deltacp's CP loss does not compute it
    and says so (a silently different loss otherwise), naming the setting; at 0 the loss runs."""
    from deltacp import cp_causal_lm_loss, parallelize_cp, shard_batch_for_cp
    from helpers import tiny_bamba

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    ids = torch.randint(3, 256, (1, 16))
    for coef in (0.01, 0.0):
        model = parallelize_cp(tiny_bamba(torch.float32, z_loss_coefficient=coef), mesh)
        batch = shard_batch_for_cp(ids, mesh, model=model)
        targets = batch.pop("target_ids")
        if coef:
            with pytest.raises(ValueError, match=r"z_loss_coefficient=0\.01.*set config\.z_loss_coefficient = 0"):
                cp_causal_lm_loss(model, targets, mesh, use_cache=False, **batch)
        else:
            assert torch.isfinite(cp_causal_lm_loss(model, targets, mesh, use_cache=False, **batch))
