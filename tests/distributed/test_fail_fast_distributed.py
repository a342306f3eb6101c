"""Fail-fast cases that need several ranks: every rank raises the documented error, nobody hangs."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from deltacp import LinearAttentionContextParallel, parallelize_qwen3_5_cp
from deltacp.testing.spawn import run_distributed
from helpers import cp_mesh, tiny_config


def _expect(error, pattern, fn):
    with pytest.raises(error, match=pattern):
        fn()


def fail_fast_worker(rank, world):
    mesh = cp_mesh()
    # Ulysses needs value heads divisible by the CP degree (6 heads at CP4).
    gdn6 = Qwen3_5GatedDeltaNet(tiny_config(linear_num_key_heads=3, linear_num_value_heads=6), 0)
    _expect(ValueError, r"linear_num_value_heads \(6\) divisible by the CP degree \(4\)",
            lambda: LinearAttentionContextParallel(mode="ulysses").apply(copy.deepcopy(gdn6), mesh))
    LinearAttentionContextParallel(mode="p2p").apply(copy.deepcopy(gdn6), mesh)  # p2p keeps all heads: fine
    _expect(ValueError, r"num_attention_heads \(6\) divisible by the CP degree \(4\)",
            lambda: parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config(num_attention_heads=6)), mesh))

    # Local sequence shorter than the conv halo (kernel 4 -> 3 tokens): raised before the halo exchange.
    gdn = LinearAttentionContextParallel(mode="p2p").apply(Qwen3_5GatedDeltaNet(tiny_config(), 0), mesh)
    _expect(ValueError, r"at least the conv halo .* = 3\) tokens, got 2", lambda: gdn(torch.randn(1, 2, 64)))

    # tp > 1 in the mesh.
    tp_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("tp", "cp"))
    _expect(ValueError, r"tp=2 is not supported with linear attention CP",
            lambda: parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()), tp_mesh))

    # Ranks that disagree on the configuration all raise (rank 0 asks for p2p, the others for ulysses) ...
    mode = "p2p" if rank == 0 else "ulysses"
    _expect(RuntimeError, r"ranks disagree on the CP configuration.*linear_attention_cp_mode='(p2p|ulysses)' vs '(p2p|ulysses)'",
            lambda: parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()), mesh,
                                           linear_attention_cp_mode=mode))
    # ... and so do ranks with different model shapes.
    heads = 8 if rank < world - 1 else 4
    _expect(RuntimeError, r"ranks disagree.*num_v_heads",
            lambda: LinearAttentionContextParallel(mode="p2p").apply(
                Qwen3_5GatedDeltaNet(tiny_config(linear_num_value_heads=heads), 0), mesh))
    # The group is still usable afterwards: a correct apply and forward go through.
    model = parallelize_qwen3_5_cp(Qwen3_5ForCausalLM(tiny_config()), mesh, linear_attention_cp_mode="p2p")
    model(input_ids=torch.randint(0, 256, (1, 16)), use_cache=False)

    # DTensor input (sequence-sharded over the CP mesh) is taken by its local tensor.
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(5)
    x_local = torch.randn(1, 32, 64)
    for mode in ("ulysses", "p2p", "all_gather"):
        layer = LinearAttentionContextParallel(mode=mode).apply(Qwen3_5GatedDeltaNet(tiny_config(), 0), mesh)
        from_dtensor = layer(DTensor.from_local(x_local, mesh, [Shard(1)]))
        assert torch.equal(from_dtensor, layer(x_local)), mode


def test_fail_fast_cp4():
    run_distributed(fail_fast_worker, 4, timeout_s=300)
