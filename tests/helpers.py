"""Shared test helpers: tiny Qwen3.5 configs, rel-L2, single-rank reference meshes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import Qwen3_5TextConfig

from deltacp.testing.gates import long_memory_gates_  # noqa: F401  (re-exported for the tests)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return ((x - ref).norm() / ref.norm().clamp(min=1e-300)).item()


def tiny_config(**overrides) -> Qwen3_5TextConfig:
    """3 linear + 1 full layers, small dims; q/k heads fewer than value heads, 2 KV heads."""
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    fields.update(overrides)
    config = Qwen3_5TextConfig(**fields)
    config._attn_implementation = fields["attn_implementation"]
    return config


def cp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))


def self_meshes() -> DeviceMesh:
    """A one-rank mesh for this rank (deltacp's own single-device computation). Collective: all ranks call."""
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == dist.get_rank():
            mine = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    return mine


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)


def local_slice(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n)


def summed_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in module.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.clone()
        dist.all_reduce(g)
        grads[name] = g
    return grads


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in module.named_parameters()}


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])

