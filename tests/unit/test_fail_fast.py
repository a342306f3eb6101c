"""Fail-fast contract (SPEC sections 3 and 5): each bad setting is a clear error naming it and the allowed
values, raised before any collective."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from deltacp import LinearAttentionContextParallel, parallelize_qwen3_5_cp
from deltacp.config import AcceleratorConfig


def test_unknown_mode_and_backend():
    with pytest.raises(ValueError, match=r"linear_attention_cp_mode='ring'.*'ulysses', 'p2p', 'all_gather'"):
        LinearAttentionContextParallel(mode="ring")
    with pytest.raises(ValueError, match=r"linear_attention_gdn_backend='auto'.*'eager', 'triton'"):
        LinearAttentionContextParallel(mode="p2p", backend="auto")


def test_all_gather_with_triton_is_not_implemented():
    with pytest.raises(NotImplementedError, match="all_gather.*no triton backend"):
        LinearAttentionContextParallel(mode="all_gather", backend="triton")


@pytest.mark.parametrize("raw, error, pattern", [
    ({"cp": 4, "tp": 2}, ValueError, r"tp=2 .*tp must be 1"),
    ({"cp": 4, "ulysses_degree": 2}, NotImplementedError, r"ulysses_degree=2 .*null or equal to cp \(4\)"),
    ({"cp": 0}, ValueError, r"cp must be an integer >= 1"),
    ({"linear_attention_cp_mode": "ring"}, ValueError, r"linear_attention_cp_mode='ring'"),
    ({"linear_attention_gdn_backend": "cuda"}, ValueError, r"linear_attention_gdn_backend='cuda'"),
    ({"linear_attention_cp_mode": "all_gather", "linear_attention_gdn_backend": "triton"}, NotImplementedError,
     "all_gather"),
    ({"cp": 2, "sp": 2}, ValueError, r"unknown key\(s\) \['sp'\]"),
])
def test_accelerator_config_validation(raw, error, pattern):
    with pytest.raises(error, match=pattern):
        AcceleratorConfig.from_dict(raw)


def test_accelerator_config_defaults_and_world_size():
    config = AcceleratorConfig.from_dict({})
    assert (config.cp, config.tp, config.ulysses_degree) == (1, 1, None)
    assert (config.linear_attention_cp_mode, config.linear_attention_gdn_backend) == ("ulysses", "eager")
    with pytest.raises(ValueError, match=r"cp \(3\) x tp \(1\) must divide the world size \(4\)"):
        AcceleratorConfig(cp=3).validate(world_size=4)


@pytest.fixture
def single_rank_group():
    from deltacp.testing.spawn import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
    with pytest.raises(NotImplementedError, match=r"ulysses_degree=2 .*None or equal to cp \(1\)"):
        parallelize_qwen3_5_cp(model, mesh, ulysses_degree=2)
    with pytest.raises(NotImplementedError, match="applies to transformers' Qwen3_5GatedDeltaNet"):
        LinearAttentionContextParallel().apply(torch.nn.Linear(2, 2), mesh)
    parallelize_qwen3_5_cp(model, mesh)
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_qwen3_5_cp(model, mesh)


def test_triton_backend_errors_clearly_without_cuda(single_rank_group):
    """backend='triton' on a machine without CUDA/Triton raises at once; it never runs eager instead."""
    model = _tiny_model()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    try:
        model = parallelize_qwen3_5_cp(model, mesh, linear_attention_cp_mode="p2p",
                                       linear_attention_gdn_backend="triton")
    except (NotImplementedError, RuntimeError, ValueError, ImportError) as err:
        assert "triton" in str(err).lower() or "cuda" in str(err).lower()
        return
    with pytest.raises((RuntimeError, ValueError), match="(?i)cuda"):
        model(input_ids=torch.randint(0, 256, (1, 64)), use_cache=False)


def test_importing_and_running_eager_never_imports_triton():
    """A guard on the import system records who imports triton; no deltacp module may be the importer."""
    code = textwrap.dedent("""
        import sys, os
        offenders = []
        class Guard:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    frame = sys._getframe(1)
                    while frame and "importlib" in frame.f_code.co_filename:
                        frame = frame.f_back
                    if frame and os.sep + "deltacp" + os.sep in frame.f_code.co_filename:
                        offenders.append(frame.f_code.co_filename)
                    raise ImportError("triton blocked by test")
                return None
        sys.meta_path.insert(0, Guard())
        import torch, deltacp
        from deltacp.testing.spawn import run_distributed
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
        assert not offenders, offenders
        assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
        print("no triton")
    """)
    import os

    from deltacp.testing.spawn import free_port

    tests_dir = os.path.dirname(os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", code, tests_dir, str(free_port())], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "no triton" in result.stdout, result.stderr[-3000:]
