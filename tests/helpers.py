"""Shared test helpers: tiny Qwen3.5 configs (and tiny models of every supported family), rel-L2, single-rank
reference meshes."""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3_5TextConfig

from deltacp.models.gates import long_memory_gates_  # noqa: F401  (re-exported for the tests)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return ((x - ref).norm() / ref.norm().clamp(min=1e-300)).item()


def head_problem(tokens=37, hidden=12, vocab=50, dtype=torch.float64, ignored=(0, 5, 36), seed=0):
    """An output head's inputs: hidden [tokens, hidden], weight [vocab, hidden] (scaled by hidden^-1/2), bias
    [vocab], targets [tokens] with IGNORE_INDEX (-100) at `ignored`; drawn in float64, cast to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[list(ignored)] = -100
    return h, w, b, t


def cuda_head_problem(tokens, hidden, vocab, seed=0):
    """The GPU tests' head inputs: bf16 hidden and weight (scaled by hidden^-1/2), targets with every 13th ignored,
    and the CUDA generator they were drawn from (for more draws)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    t[::13] = -100
    return h, w, t, g


class TensorShapes(TorchDispatchMode):
    """Records the shape of every tensor an op under this mode returns (`.shapes`)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.shapes.append(tuple(x.shape))
        return out


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


def computed_once(*fns) -> list:
    """fns[i]() run on rank i % world alone, and every result (tensors, numbers, containers of them) sent to every
    rank, in order: references that every rank would compute identically, computed once and spread over the ranks
    (which share the machine's cores). Collective: every rank calls it, with as many functions."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {i: fn() for i, fn in enumerate(fns) if i % world == rank}
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    results = {i: r for part in parts for i, r in part.items()}
    return [results[i] for i in range(len(fns))]


def _with_environment(caller: int, environ: dict, fn, *args) -> None:
    import os

    from deltacp.distributed.launch import die_with_caller

    if os.getppid() != caller:  # forked by the server: its environment, and the caller is not its parent
        die_with_caller(caller)
        os.environ.clear()
        os.environ.update(environ)
    fn(*args)


@contextlib.contextmanager
def started_in_process(fn, *args, timeout_s: float = 600, what: str = "the one-process reference runs"):
    """fn(*args) in a fresh process (a reference that must not share this process's state, e.g. the plain trainers
    on one process) while the body runs (e.g. the CP ranks, which leave cores idle while they wait for each other);
    on leaving, pytest fails naming `what` if it failed or outlives `timeout_s` from its start. The process is forked
    from the suite's preloaded server where the ranks are (`tests/conftest.py`: torch, transformers and deltacp
    imported once; the caller's environment applied), else spawned."""
    import multiprocessing
    import os
    import time

    import pytest

    from deltacp.distributed.launch import start_method

    proc = multiprocessing.get_context(start_method()).Process(target=_with_environment,
                                                                args=(os.getpid(), dict(os.environ), fn, *args))
    deadline = time.monotonic() + timeout_s
    proc.start()
    try:
        yield
    except BaseException:
        proc.kill()
        proc.join()
        raise
    proc.join(max(0.0, deadline - time.monotonic()))
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{what} did not finish in {timeout_s:.0f} s")
    assert proc.exitcode == 0, f"{what} failed"


def single_device_jobs(path: str, jobs: list) -> None:
    """The training parity tool's single-device jobs [(label, config)] in this process, a gloo group of one (what
    `deltacp.train.parity.run_jobs(1, jobs)` runs in its one rank); {label: rows} written to `path` as JSON (the
    rows' numbers read back exactly). For `started_in_process`, beside the CP ranks."""
    import json
    import os

    from deltacp.distributed.launch import free_port
    from deltacp.train.parity import _worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    results = {}
    _worker(0, 1, jobs, results, None)
    dist.destroy_process_group()
    with open(path, "w") as f:
        json.dump(results, f)


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)


def local_slice(x: torch.Tensor, rank: int, world: int, dim: int = 1, layout: str = "contiguous") -> torch.Tensor:
    """This rank's tokens of x along `dim`, written here independently of deltacp's placement code: contiguous,
    [rank n, (rank + 1) n); balanced, pieces rank and 2 world - 1 - rank of the row cut into 2 world pieces."""
    if layout == "contiguous":
        n = x.shape[dim] // world
        return x.narrow(dim, rank * n, n)
    assert layout == "balanced", layout
    h = x.shape[dim] // (2 * world)
    return torch.cat([x.narrow(dim, rank * h, h), x.narrow(dim, (2 * world - 1 - rank) * h, h)], dim=dim)


def run_fwd_bwd(module: torch.nn.Module, x: torch.Tensor, d_out: torch.Tensor, **kwargs):
    """module(x, **kwargs) and the backward of (out * d_out).sum(): the output (detached) and x's gradient."""
    x = x.clone().requires_grad_()
    out = module(x, **kwargs)
    (out * d_out).sum().backward()
    return out.detach(), x.grad


def tiny_attention(config, layer_idx: int = 3) -> torch.nn.Module:
    """transformers' Qwen3_5Attention in float64 with non-trivial q/k norm weights (their init is all zeros)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    base = Qwen3_5Attention(config, layer_idx).double()
    with torch.no_grad():
        base.q_norm.weight.normal_(0, 0.1)
        base.k_norm.weight.normal_(0, 0.1)
    return base


def per_document_attention(q, k, v, cu, scale):
    """Causal attention per document of the flattened [B * S] stream (q [B, H, S, D], k/v [B, Hk, S, D]), one
    SDPA each: the reference of the tile-by-tile attention."""
    import torch.nn.functional as F

    B, H, S, D = q.shape
    flat = [x.transpose(1, 2).reshape(B * S, x.shape[1], D) for x in (q, k, v)]
    bounds = cu.tolist()
    o = torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1)[None] for x in flat), is_causal=True,
                                                  scale=scale, enable_gqa=True)[0].transpose(0, 1)
                   for a, b in zip(bounds[:-1], bounds[1:])])
    return o.reshape(B, S, H, D).transpose(1, 2)


def summed_over_ranks(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: tensor} summed over the default group in place, by one all-reduce per dtype (a collective per tensor
    costs its latency each: at 8 ranks on 2 cores about 20 ms). Returns `grads`."""
    for dtype in dict.fromkeys(g.dtype for g in grads.values()):
        names = [n for n, g in grads.items() if g.dtype == dtype]
        total = torch.cat([grads[n].reshape(-1) for n in names])
        dist.all_reduce(total)
        for n, part in zip(names, total.split([grads[n].numel() for n in names])):
            grads[n].copy_(part.view_as(grads[n]))
    return grads


def full_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: tensor} with every DTensor made whole and detached: FSDP2's shards (dim 0 over a 1-D mesh) by one
    object all-gather per mesh, their local pieces concatenated in rank order (`full_tensor()` is one collective per
    tensor, a collective's latency each); other DTensors by `full_tensor()`; plain tensors as they are. A collective
    over each DTensor's mesh, in the dict's order."""
    from torch.distributed.tensor import DTensor, Shard

    out, by_mesh = {}, {}
    for name, t in tensors.items():
        if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),):
            by_mesh.setdefault(id(t.device_mesh), (t.device_mesh, {}))[1][name] = t
        else:
            out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
    for mesh, shards in by_mesh.values():
        group = mesh.get_group()
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, {n: t.to_local().detach().cpu() for n, t in shards.items()}, group=group)
        for n, t in shards.items():
            out[n] = torch.cat([part[n] for part in parts]).to(t.device)
    return {n: out[n] for n in tensors}


def summed_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return summed_over_ranks(grads_of(module))


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in module.named_parameters()}


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])



# ---------------------------------------------------------------------------------------------------------------
# Tiny models of every supported family (3 GDN + 1 full attention layers, hidden 32)
# ---------------------------------------------------------------------------------------------------------------

FAMILY_CLASSES = ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
                  "Qwen3_5MoeForConditionalGeneration")
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 250, 251, 252, 253
TEXT_VOCAB = 240  # text tokens drawn below the vision special tokens


def tiny_text_fields(**overrides) -> dict:
    fields = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields.update(overrides)
    return fields


MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  router_aux_loss_coef=0.25)
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32, patch_size=2,
                   temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)


def tiny_family_model(name: str, dtype=torch.float64, **text_overrides) -> torch.nn.Module:
    """A tiny random model of class `name` as transformers builds it (sdpa attention; eager experts, which
    run in float64 on the CPU where grouped_mm does not); `text_overrides` change `tiny_text_fields`.
    OlmoHybridForCausalLM: `tiny_olmo_hybrid` (RoPE; "OlmoHybridForCausalLM-nope": NoPE);
    Qwen4ExpForConditionalGeneration: `QWEN4_EXP_FIELDS` with a PLE layer (1) and the tiny vision tower."""
    import transformers

    if name.startswith("OlmoHybridForCausalLM"):
        return tiny_olmo_hybrid(rope=not name.endswith("-nope"), dtype=dtype)
    if name == "BambaForCausalLM":
        return tiny_bamba(dtype)
    if name == "NemotronHForCausalLM":
        return tiny_nemotron_h(dtype)
    if name == "Mamba2ForCausalLM":
        return tiny_mamba2(dtype)
    if name == "Zamba2ForCausalLM":
        return tiny_zamba2(dtype)
    if name == "ZambaForCausalLM":
        return tiny_zamba(dtype)
    if name in ("MambaForCausalLM", "FalconMambaForCausalLM"):
        return tiny_mamba(dtype, falcon=name.startswith("Falcon"))
    if name == "GraniteMoeHybridForCausalLM":
        return tiny_granite_hybrid(dtype)
    if name == "JambaForCausalLM":
        return tiny_jamba(dtype)
    if name == "RecurrentGemmaForCausalLM":
        return tiny_recurrent_gemma(dtype)
    if name == "FalconH1ForCausalLM":
        return tiny_falcon_h1(dtype)
    if name == "KimiLinearForCausalLM":
        return tiny_kimi_linear(dtype)
    if name == "BailingHybridForCausalLM":
        return tiny_bailing_hybrid(dtype)
    if name == "MiniMaxForCausalLM":
        return tiny_minimax(dtype)
    if name == "LaraMiniForCausalLM":
        return tiny_lara_mini(dtype, **text_overrides)
    if name == "Lfm2ForCausalLM":
        return tiny_lfm2(dtype, **text_overrides)
    if name == "Lfm2MoeForCausalLM":
        return tiny_lfm2_moe(dtype, **text_overrides)
    if name == "Lfm3ForCausalLM":
        return tiny_lfm3(dtype, **text_overrides)
    if name == "Qwen4ExpForConditionalGeneration":  # tiny_qwen4_exp's text model with a PLE layer (its conv drawn),
        # the tiny vision tower
        text = {**QWEN4_EXP_FIELDS, "ple_layer_ids": [1], "ngram_vocab_size_base": 64, **text_overrides}
        config = transformers.Qwen4ExpConfig(text_config=text,
                                             vision_config=dict(TINY_VISION), image_token_id=IMAGE_TOKEN_ID,
                                             video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
                                             vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)
        for cfg in (config, config.text_config):
            cfg._attn_implementation = "sdpa"
            cfg._experts_implementation = "eager"
        config.vision_config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = long_memory_gates_(transformers.Qwen4ExpForConditionalGeneration(config))
        gen = torch.Generator().manual_seed(4321)
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                if layer.ple is not None:
                    layer.ple.conv1d.weight.copy_(torch.randn(layer.ple.conv1d.weight.shape, generator=gen) * 0.3)
        return model.to(dtype)
    text = tiny_text_fields(**text_overrides)
    if name == "Qwen3_5ForCausalLM":
        config = transformers.Qwen3_5TextConfig(**text)
    elif name == "Qwen3_5MoeForCausalLM":
        config = transformers.Qwen3_5MoeTextConfig(**text, **MOE_FIELDS)
    elif name == "Qwen3NextForCausalLM":
        config = transformers.Qwen3NextConfig(**text, **MOE_FIELDS, decoder_sparse_step=1, mlp_only_layers=[1],
                                              norm_topk_prob=True)
    elif name in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        moe = name.startswith("Qwen3_5Moe")
        config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        config = config_cls(text_config=dict(text, **(MOE_FIELDS if moe else {})), vision_config=dict(TINY_VISION),
                            image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                            vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
                            tie_word_embeddings=False)
    else:
        raise ValueError(name)
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"
    if hasattr(config, "vision_config"):
        config.vision_config._attn_implementation = "sdpa"
    model = getattr(transformers, name)(config)
    return long_memory_gates_(model).to(dtype)


def _mamba2_model(cls, config, mixer_of, dtype) -> torch.nn.Module:
    """`cls(config)` seeded (sdpa attention, eager experts), its Mamba2 mixers (`mixer_of(layer)`, None elsewhere)
    with slowly decaying heads (A_log from [-5, -1]: the state of one rank matters on the next), D and the gated
    norm's weight away from their init."""
    config._attn_implementation = "sdpa" if cls._supports_sdpa else "eager"  # Mamba2: no attention, no sdpa
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for mixer in filter(None, map(mixer_of, model.base_model.layers)):
            mixer.A_log.copy_(torch.empty(mixer.A_log.shape).uniform_(-5, -1, generator=gen))
            mixer.dt_bias.copy_(torch.empty(mixer.dt_bias.shape).uniform_(-2, 0, generator=gen))
            mixer.D.copy_(torch.empty(mixer.D.shape).uniform_(0.5, 1.5, generator=gen))
            if hasattr(mixer.norm, "weight"):  # Falcon-H1 without mamba_rms_norm: an identity (y * silu(z))
                mixer.norm.weight.copy_(torch.empty(mixer.norm.weight.shape).normal_(1, 0.1, generator=gen))
    return model.to(dtype)


def tiny_bamba(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random BambaForCausalLM (seeded): hidden 32, layers Mamba2 / attention / Mamba2 / Mamba2, 8 heads of
    head dim 8 in 2 groups of B/C with state 6, conv kernel 4 with bias; attention 8 heads over 2 KV heads, RoPE on
    half the head dim. Slowly decaying heads (A_log drawn from [-5, -1]: the state of one rank matters on the
    next), D and the norm weights away from their init."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, attn_layer_indices=[1],
                  num_attention_heads=8, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_expand=2,
                  mamba_n_groups=2, mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=16, rms_norm_eps=1e-6,
                  max_position_embeddings=65536, tie_word_embeddings=False, pad_token_id=0)
    config = transformers.BambaConfig(**{**fields, **overrides})
    return _mamba2_model(transformers.BambaForCausalLM, config, lambda layer: getattr(layer, "mamba", None), dtype)


def tiny_mamba2(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random Mamba2ForCausalLM (seeded): hidden 32, 3 Mamba2 blocks, 8 heads of dim 8 (expand 2) in 2 groups
    with state 6, conv kernel 4 with bias, chunk 16; no attention, no MLP."""
    import transformers

    config = transformers.Mamba2Config(**{**dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8, expand=2, n_groups=2,
        state_size=6, conv_kernel=4, chunk_size=16, tie_word_embeddings=False, pad_token_id=0), **overrides})
    return _mamba2_model(transformers.Mamba2ForCausalLM, config, lambda layer: layer.mixer, dtype)


def mamba1_away_from_init_(m, uniform) -> None:
    """A Mamba1 mixer's slow decays (A_log from [-5, -1]), dt_proj's bias (Zamba's `dt_proj_bias`), D and its biases
    away from their init; `uniform(tensor, lo, hi)` draws in place."""
    uniform(m.A_log, -5, -1)
    uniform(m.dt_proj.bias if hasattr(m, "dt_proj") else m.dt_proj_bias, -2, 0)
    uniform(m.D, 0.5, 1.5)
    for bias in (m.conv1d.bias, m.in_proj.bias, m.out_proj.bias):
        if bias is not None:
            uniform(bias, -0.2, 0.2)


def tiny_mamba(dtype=torch.float64, falcon: bool = False, **overrides) -> torch.nn.Module:
    """A tiny random MambaForCausalLM (FalconMambaForCausalLM with `falcon`), seeded: hidden 16, 2 blocks, I = 32
    (expand 2), state 4, dt rank 3, conv kernel 4 with bias, in_proj / out_proj with bias; slowly decaying channels
    (A_log from [-5, -1]), dt_proj's bias, D, the conv bias and the block norms away from their init."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4,
                  time_step_rank=3, use_bias=True, use_conv_bias=True, tie_word_embeddings=False, pad_token_id=0)
    cls = transformers.FalconMambaForCausalLM if falcon else transformers.MambaForCausalLM
    config = (transformers.FalconMambaConfig if falcon else transformers.MambaConfig)(**{**fields, **overrides})
    torch.manual_seed(0)
    model = cls(config)
    gen = torch.Generator().manual_seed(1234)
    uniform = lambda t, lo, hi: t.copy_(torch.empty(t.shape).uniform_(lo, hi, generator=gen))  # noqa: E731
    with torch.no_grad():
        for layer in model.backbone.layers:
            mamba1_away_from_init_(layer.mixer, uniform)
            uniform(layer.norm.weight, 0.8, 1.2)
        uniform(model.backbone.norm_f.weight, 0.8, 1.2)
    return model.to(dtype)


def tiny_falcon_mamba(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """`tiny_mamba` as a FalconMambaForCausalLM (the weightless RMSNorms on dt, B and C)."""
    return tiny_mamba(dtype, falcon=True, **overrides)


def tiny_jamba(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random JambaForCausalLM (seeded): hidden 16, layers Mamba1 / attention / Mamba1 (attn_layer_period 3,
    offset 1), routed experts after both Mamba1 layers (expert_layer_period 2, offset 0: 4 SwiGLU experts of 24, top
    2, not renormalised), a dense MLP after the attention; Mamba1 I = 32, state 4, dt rank 3, conv 4 with bias,
    in_proj / out_proj with bias; attention 4 heads of 4 over 2 KV heads, NoPE. Slowly decaying channels (A_log from
    [-5, -1]), dt_proj's bias, D, the biases and every norm weight (the dt / B / C norms included) away from their
    init; eager experts."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=4, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=3, mamba_conv_bias=True, mamba_proj_bias=True,
                  router_aux_loss_coef=0.25, tie_word_embeddings=False, pad_token_id=0)
    config = transformers.JambaConfig(**{**fields, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(config)
    mixers = [layer.mamba for layer in model.model.layers if getattr(layer, "mamba", None) is not None]
    return mamba1_hybrid_away_from_init_(model, mixers).to(dtype)


def mamba1_hybrid_away_from_init_(model, mixers):
    """`mamba1_away_from_init_` on each of `mixers` and every norm weight of `model` drawn from [0.6, 1.4] (seeded);
    returns the model."""
    gen = torch.Generator().manual_seed(1234)
    uniform = lambda t, lo, hi: t.copy_(torch.empty(t.shape).uniform_(lo, hi, generator=gen))  # noqa: E731
    with torch.no_grad():
        for m in mixers:
            mamba1_away_from_init_(m, uniform)
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                uniform(p, 0.6, 1.4)
    return model


def tiny_zamba(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random ZambaForCausalLM (seeded): hidden 16, layers Mamba1 / hybrid / Mamba1 / hybrid (both hybrid
    layers run the ONE shared block: tied parameters); Mamba1 I = 32 in 2 heads of 16 (x / z interleaved in in_proj),
    state 4, dt rank 3, conv 4 with bias, in_proj / out_proj with bias; attention on concat(hidden, embeddings) (width
    32) 4 heads of 8 over 2 KV heads, NoPE; gelu MLP 24; tied embeddings (the default: transformers ties the shared
    block's instances only under tie_word_embeddings); weights drawn with std 0.1 (the default
    0.02 leaves the shared block's input nearly the same at every hybrid layer, its outputs with it). Slowly decaying
    channels (A_log from [-5, -1]), dt_proj_bias, D, the biases and every norm weight away from their init."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=16, num_hidden_layers=4, intermediate_size=24,
                  layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
                  num_attention_heads=4, num_key_value_heads=2, n_mamba_heads=2, mamba_d_state=4, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=3, mamba_conv_bias=True, mamba_proj_bias=True, pad_token_id=0,
                  initializer_range=0.1)
    config = transformers.ZambaConfig(**{**fields, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.ZambaForCausalLM(config)
    mixers = [layer.mamba if hasattr(layer, "mamba") else layer.mamba_decoder.mamba for layer in model.model.layers]
    return mamba1_hybrid_away_from_init_(model, mixers).to(dtype)


def tiny_zamba2(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random Zamba2ForCausalLM (seeded): hidden 32, layers Mamba2 / hybrid / Mamba2 / hybrid / hybrid, the
    hybrid layers cycling 2 shared blocks (the first and third hybrid layers share one: tied parameters) with LoRA
    adapters of rank 4 and RoPE; Mamba2 8 heads of 8 in 2 groups, state 6, conv 4; attention 8 heads of 8 (no GQA:
    transformers adds the adapters to k and v at the query width), MLP 48, chunk 16; tied embeddings (the default)."""
    import transformers

    config = transformers.Zamba2Config(**{**dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=5,
        layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid", "hybrid"], mamba_d_state=6,
        n_mamba_heads=8, mamba_ngroups=2, num_attention_heads=8, num_key_value_heads=8, intermediate_size=48,
        num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, chunk_size=16,
        pad_token_id=0), **overrides})
    return _mamba2_model(transformers.Zamba2ForCausalLM, config,
                         lambda layer: layer.mamba if hasattr(layer, "mamba") else layer.mamba_decoder.mamba, dtype)


RECURRENT_GEMMA_FIELDS = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=20,
                              conv1d_width=4, logits_soft_cap=2.0, pad_token_id=0)


def tiny_recurrent_gemma(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random RecurrentGemmaForCausalLM (seeded): hidden 32, layers recurrent, recurrent, attention
    (block_types' default cycle); RG-LRU width 32 in 4 gate blocks of 8 (transformers' init: slow decays), conv 4
    with bias; attention 4 heads of 8 over 1 KV head (MQA), partial RoPE 0.5 (4 dims), window 20 (crosses every rank
    boundary, longer than the balanced pieces at CP2); MLP 24 with biases; logits soft-capped at 2 (small: the
    tiny logits reach the tanh's curve); tied head; sdpa attention."""
    import transformers

    config = transformers.RecurrentGemmaConfig(**{**RECURRENT_GEMMA_FIELDS, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(config).to(dtype)
    model.model.register_forward_hook(_drop_recurrent_states)
    return model


def _drop_recurrent_states(text, args, output) -> None:
    """After a forward of transformers' RecurrentGemma: its recurrent blocks keep their last states on module
    attributes even with use_cache=False (`rg_lru.recurrent_states`, with its autograd graph), which deepcopy (the
    tests' copies of the reference model) refuses; every forward with use_cache=False starts from None again, so
    dropping them changes no result."""
    for layer in text.layers:
        block = layer.temporal_block
        if hasattr(block, "rg_lru"):
            block.conv1d_state = block.rg_lru.recurrent_states = None


def tiny_nemotron_h(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random NemotronHForCausalLM (seeded): hidden 32, blocks Mamba2 / MoE / attention / Mamba2 / MLP, 8 Mamba
    heads of dim 4 in 2 groups with state 6, conv with bias; attention 8 heads over 2 KV heads, no RoPE; 4 relu2
    experts top-2 and a shared expert (eager experts: float64 on the CPU); `overrides` change config fields."""
    import transformers

    config = transformers.NemotronHConfig(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2,
        head_dim=4, mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=6, conv_kernel=4, chunk_size=16,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        n_group=1, topk_group=1, max_position_embeddings=65536, tie_word_embeddings=False, pad_token_id=0),
        **overrides})
    return _mamba2_model(transformers.NemotronHForCausalLM, config,
                         lambda layer: layer.mixer if type(layer.mixer).__name__ == "NemotronHMamba2Mixer" else None,
                         dtype)


def tiny_granite_hybrid(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random GraniteMoeHybridForCausalLM (seeded): hidden 32, layers Mamba2 / attention / Mamba2 / Mamba2 (8
    heads of dim 8 in 2 groups, state 6), RoPE, 4 experts top-2 plus the shared MLP, muP multipliers away from 1
    (embedding 2, residual 0.7, attention 0.3, logits 1.5), aux loss coefficient 0.25; eager experts."""
    import transformers

    config = transformers.GraniteMoeHybridConfig(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, shared_intermediate_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=8, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_expand=2,
        mamba_n_groups=2, mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=16, num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.25, position_embedding_type="rope", embedding_multiplier=2.0,
        residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=1.5, max_position_embeddings=65536,
        tie_word_embeddings=False, pad_token_id=0), **overrides})
    return _mamba2_model(transformers.GraniteMoeHybridForCausalLM, config, lambda layer: layer.mamba, dtype)


def tiny_falcon_h1(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random FalconH1ForCausalLM (seeded): hidden 32, 3 layers each running Mamba2 (8 heads of dim 8 in 2
    groups, state 6, the grouped gated RMSNorm) and attention (8 heads over 2 KV heads, full RoPE) in parallel; every
    muP multiplier away from 1; `overrides` change config fields."""
    import transformers

    config = transformers.FalconH1Config(**{**dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=4, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=6, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True, lm_head_multiplier=0.8,
        embedding_multiplier=1.5, mlp_multipliers=[1.2, 0.9], key_multiplier=0.7, attention_out_multiplier=0.9,
        attention_in_multiplier=1.1, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=0.9,
        ssm_out_multiplier=1.2, max_position_embeddings=65536, tie_word_embeddings=False, pad_token_id=0),
        **overrides})
    return _mamba2_model(transformers.FalconH1ForCausalLM, config, lambda layer: layer.mamba, dtype)


OLMO_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def tiny_olmo_hybrid(rope: bool = True, dtype=torch.float64, beta_gain: float = 20.0, **overrides) -> torch.nn.Module:
    """A tiny random OlmoHybridForCausalLM as transformers builds it (seeded: the same on every rank): hidden 32,
    layers GDN / attention / GDN / GDN, 2 key heads for 8 value heads of K = 12, V = 24, attention 8 heads over 2 KV
    heads of 8; RoPE, or NoPE (rope=False: no rope theta, no rotary module). Slowly decaying gates; the b projection
    scaled by `beta_gain` so that beta = 2 sigmoid(b) reaches 2 on many tokens (the state flips sign)."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, layer_types=OLMO_LAYERS,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=8, linear_key_head_dim=12, linear_value_head_dim=24, linear_conv_kernel_dim=4,
                  max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
                  eos_token_id=1, linear_allow_neg_eigval=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0} if rope else None)
    fields.update(overrides)
    config = transformers.OlmoHybridConfig(**fields)
    if not rope:
        config.rope_parameters = None
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.OlmoHybridForCausalLM(config)
    assert (model.model.rotary_emb is not None) == rope
    with torch.no_grad():
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:  # norm weights away from their init of ones
                attn.q_norm.weight.normal_(1, 0.1)
                attn.k_norm.weight.normal_(1, 0.1)
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None:
                gdn.b_proj.weight.mul_(beta_gain)
                gdn.o_norm.weight.normal_(1, 0.1)
    return long_memory_gates_(model).to(dtype)


def image_batch(B: int, S: int, grid=(1, 4, 4), starts=(5,), seed: int = 0):
    """Token ids [B, S] with one image (grid t, h, w patches; merged 2x2) per entry of `starts` in row 0 (a
    vision-start token, the image tokens, a vision-end token), the processor's mm_token_type_ids, pixel_values
    [patches, 3 * 2 * 2 * 2] and image_grid_thw."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT_VOCAB, (B, S), generator=gen)
    types = torch.zeros(B, S, dtype=torch.long)
    t, h, w = grid
    n = t * h * w // 4
    for start in starts:
        ids[0, start - 1], ids[0, start + n] = VISION_START_ID, VISION_END_ID
        ids[0, start:start + n] = IMAGE_TOKEN_ID
        types[0, start:start + n] = 1
    patches = len(starts) * t * h * w
    pixel_values = torch.randn(patches, 3 * 2 * 2 * 2, generator=gen, dtype=torch.float64)
    grid_thw = torch.tensor([list(grid)] * len(starts))
    return ids, types, pixel_values, grid_thw


class DownProjProducts(TorchDispatchMode):
    """Counts the down_proj forward products of a decoder model's MLPs while active: matmuls whose second operand is
    a down_proj weight transposed ([intermediate, hidden]; the backward's dx product reads it as it is)."""

    MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
               torch.ops.aten.addmm.out)

    def __init__(self, model):
        super().__init__()
        self.weights = {layer.mlp.down_proj.weight.data_ptr() for layer in model.model.layers}
        self.shape = (model.config.intermediate_size, model.config.hidden_size)
        self.count = 0

    def observe(self, func, args) -> None:
        if func in self.MATMULS:
            b = args[2] if "addmm" in str(func) else args[1]
            self.count += b.data_ptr() in self.weights and tuple(b.shape) == self.shape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.observe(func, args)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def float64_upcasts(factories_in=()):
    """Within the block, a cast of a float64 tensor to float32 keeps float64 (`Tensor.to`, `Tensor.float`,
    `Tensor.type`, the `dtype=` of softmax / log_softmax), and the modules of `factories_in` see a `torch` whose
    tensor factories (zeros, empty, full, ones, tensor and their `_like` forms) make float64 where they are asked for
    float32 (TRL's chunked log-probability head allocates float32 accumulators; widened everywhere, the factories
    would also widen buffers that a collective fills with float32 bytes).

    transformers (RMSNorms, gates, rotary, its GDN fallback) and TRL compute in float32 where a bf16 model wants it;
    for a float64 model that rounds to float32, so a float64 run of theirs and one of ours differ by float32
    rounding, which training amplifies. Inside the block both compute in float64 throughout, and a parity test bounds
    the difference by float64 rounding instead of sitting at float32 noise. Applied alike to the reference and to
    the run under test; other dtypes are untouched."""
    import types

    import torch.nn.functional as F

    f64, f32 = torch.float64, torch.float32
    to, float_, type_ = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type
    softmaxes = {name: getattr(F, name) for name in ("softmax", "log_softmax")}

    def widened_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if self.dtype == f64 and out.dtype == f32:
            out = to(self, device=out.device, dtype=f64, copy=kwargs.get("copy", False),
                     memory_format=kwargs.get("memory_format", torch.preserve_format))
        return out

    def widened_float(self, *args, **kwargs):
        return self if self.dtype == f64 else float_(self, *args, **kwargs)

    def widened_type(self, dtype=None, *args, **kwargs):
        if dtype in (f32, "torch.FloatTensor") and self.dtype == f64:
            return self
        return type_(self, dtype, *args, **kwargs)

    def widened(fn):
        def call(*args, **kwargs):
            if kwargs.get("dtype") == f32:
                kwargs["dtype"] = f64
            return fn(*args, **kwargs)
        return call

    factories = {name: widened(getattr(torch, name)) for name in (
        "zeros", "empty", "full", "ones", "tensor", "zeros_like", "empty_like", "full_like", "ones_like")}

    class WidenedTorch(types.ModuleType):
        def __getattr__(self, name):
            return factories[name] if name in factories else getattr(torch, name)

    modules = {module: module.torch for module in factories_in}
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = widened_to, widened_float, widened_type
    for name, fn in softmaxes.items():
        setattr(F, name, widened(fn))
    for module in modules:
        module.torch = WidenedTorch("torch")
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to, float_, type_
        for name, fn in softmaxes.items():
            setattr(F, name, fn)
        for module, original in modules.items():
            module.torch = original


def _kda_model(cls, config, dtype) -> torch.nn.Module:
    """`cls(config)` seeded (sdpa attention, eager experts) with transformers' init, then slowly decaying KDA gates
    (`long_memory_gates_`), the gated output norms' and the MLA latent norms' weights away from ones."""
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = long_memory_gates_(cls(config))
    gen = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_norm.weight", "kv_a_layernorm.weight", "q_a_layernorm.weight")):
                p.copy_(torch.empty(p.shape).normal_(1, 0.1, generator=gen))
    return model.to(dtype)


def tiny_kimi_linear(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random KimiLinearForCausalLM (seeded): hidden 32, layers KDA / MLA / KDA / KDA (`self_attn` of each),
    MLPs dense / routed / dense / routed; KDA 8 heads of D = 8, conv kernel 4; MLA 8 heads, kv_lora_rank 16, no
    q_lora, qk head dim 8 + 4 (nope + the unrotated shared "rope" slice), v_head_dim 6 (!= 12); 4 experts in 2
    groups, top-2 from 1 group, routed_scaling_factor 2.446, a shared expert. Slowly decaying KDA gates
    (`long_memory_gates_`: per channel g from about -0.5 to -0.002 per token)."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                  mlp_layer_types=["dense", "sparse", "dense", "sparse"], num_attention_heads=8,
                  num_key_value_heads=8, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=6, linear_num_heads=8, linear_head_dim=8, linear_conv_kernel_dim=4, num_local_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.446,
                  rms_norm_eps=1e-6, max_position_embeddings=65536, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    config = transformers.KimiLinearConfig(**{**fields, **overrides})
    return _kda_model(transformers.KimiLinearForCausalLM, config, dtype)


def _bounded_gate_(gate, gen) -> None:
    """A bounded forget gate (Bailing-Hybrid's, GLM-5.3-Flash's) drawn away from its init: A_log from U(-0.5, 0.5),
    dt_bias slow (U(-9, -5)) on three channels of four, fast (U(0, 3)) on the fourth. None: a layer without one."""
    if gate is not None:
        gate.A_log.copy_(torch.empty(gate.A_log.shape).uniform_(-0.5, 0.5, generator=gen))
        slow = torch.empty(gate.dt_bias.shape).uniform_(-9, -5, generator=gen)
        fast = torch.empty(gate.dt_bias.shape).uniform_(0, 3, generator=gen)
        gate.dt_bias.copy_(torch.where(torch.arange(gate.dt_bias.numel()) % 4 == 3, fast, slow))


def tiny_bailing_hybrid(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random BailingHybridForCausalLM (seeded): hidden 32, layers KDA / MLA / KDA / KDA, MLPs dense / routed
    / routed / dense (SwiGLU clamps of 0.05 on the routed layers' experts and shared experts); KDA 8 heads of D = 8
    with the safe gate (g in [-5, 0]); MLA 8 heads, q_lora_rank 12, kv_lora_rank 16, qk head dim 8 + 4 (interleaved
    RoPE on the 4), v_head_dim 6, YaRN rope (factor 4, mscale_all_dim 1: the softmax scale gains mscale^2), the
    per-head output gate; 4 experts in 2 groups, top-2 from 1 group, routed_scaling_factor 2.5, a shared expert.
    KDA gates: exp(A_log) from [0.6, 1.6] per head, dt_bias per channel from [-9, -5] on three channels in four (g
    about -5 sigmoid(-7): slow, the state of one rank matters on the next) and [0, 3] on the fourth (near the bound)."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                  mlp_layer_types=["dense", "sparse", "sparse", "dense"], num_attention_heads=8,
                  num_key_value_heads=8, head_dim=8, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=6, short_conv_kernel_size=4, num_local_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                  expert_swiglu_limit_list=[0, 0.05, 0.05, 0], share_expert_swiglu_limit_list=[0, 0.05, 0.05, 0],
                  kda_safe_gate=True, kda_lower_bound=-5.0, rms_norm_eps=1e-6, max_position_embeddings=64,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0},
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = transformers.BailingHybridConfig(**{**fields, **overrides})
    model = _kda_model(transformers.BailingHybridForCausalLM, config, dtype)
    gen = torch.Generator().manual_seed(5678)
    with torch.no_grad():
        for layer in model.model.layers:
            _bounded_gate_(getattr(layer.self_attn, "forget_gate", None), gen)
    return model


def interpreter_figures(code: str, drop_env: tuple[str, ...] = (), parts: int = 1) -> dict:
    """Run `code` in a fresh process under TRITON_INTERPRET=1 (set before triton loads; `drop_env` names variables
    left out) and read its report: lines "FIG case dtype quantity value" -> {(case, dtype, quantity): value}, and the
    word after "SUMMARY_GRAD" -> ["summary_grad"]. The code ends by printing DONE. parts > 1: `code` runs once per
    part with PART = 0 .. parts - 1 defined first, the parts side by side (`concurrent_runs`), their reports merged.
    Skips the calling test (or fixture) where triton is not installed."""
    import importlib.util
    import os
    import sys

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")

    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    outs = concurrent_runs({part: [sys.executable, "-c", f"PART = {part}\n" + code] for part in range(parts)},
                           env=dict(env, TRITON_INTERPRET="1"))
    figs, lines = {}, []
    for out in outs.values():
        assert out.returncode == 0 and out.stdout.strip().endswith("DONE"), out.stdout[-3000:] + out.stderr[-3000:]
        lines += out.stdout.splitlines()
    for line in lines:
        if line.startswith("FIG "):
            _, case, dtype, name, value = line.split()
            figs[(case, dtype, name)] = float(value)
    figs["summary_grad"] = next(line.split()[1] for line in lines if line.startswith("SUMMARY_GRAD"))
    return figs


def concurrent_runs(argvs: dict, env: dict | None = None, timeout: int = 600, envs: dict | None = None) -> dict:
    """{label: argv} run as subprocesses, as many at a time as the machine has cores (independent interpreter cases:
    one process each uses one core; `envs`: {label: environment} where they differ, else `env`) -> {label:
    subprocess.CompletedProcess} (stdout and stderr as text)."""
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def run(label):
        return subprocess.run(argvs[label], capture_output=True, text=True, timeout=timeout,
                              env=(envs or {}).get(label, env))

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = {label: pool.submit(run, label) for label in argvs}
        return {label: future.result() for label, future in futures.items()}


QWEN4_EXP_FIELDS = dict(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                        hc_count=2, hc_lowrank=8, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=8,
                        indexer_budget=12, indexer_compress_ratio=3, max_position_embeddings=4096,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                         "mrope_section": [1, 1, 0]},
                        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2)


def tiny_qwen4_exp(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random Qwen4ExpForCausalLM (seeded): hidden 32, 2 hyper-connection streams (rank 8), layers GDN, GDN,
    GDN, indexed attention; GDN 2 key heads for 4 value heads of 16; attention 4 heads of 16 over 2 KV heads, partial
    mRoPE (4 rotary dims); QSA 8 indexer heads of 8, blocks of 3 tokens, budget 12 (the top 4 blocks: sparse past
    15 tokens, and a block straddles every rank boundary not at a multiple of 3); 4 experts, top 2; no PLE unless
    `ple_layer_ids` (its conv drawn from N(0, 0.3^2): transformers starts it at zeros); slow GDN decays; sdpa
    attention, eager experts."""
    import transformers

    from deltacp.models.gates import long_memory_gates_

    config = transformers.Qwen4ExpTextConfig(**{**QWEN4_EXP_FIELDS, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = long_memory_gates_(transformers.Qwen4ExpForCausalLM(config))
    gen = torch.Generator().manual_seed(4321)
    with torch.no_grad():  # transformers initialises the PLE conv to zeros: draw it, so the forward reads its halo
        for layer in model.model.layers:
            if layer.ple is not None:
                layer.ple.conv1d.weight.copy_(torch.randn(layer.ple.conv1d.weight.shape, generator=gen) * 0.3)
    return model.to(dtype)


GLM5_NEXT_FIELDS = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                                                          "linear_attention"],
                        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense",
                                                                                            "sparse"],
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=6, index_n_heads=8, index_head_dim=8,
                        index_kpool=3, index_topk=9, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                        hc_mult=4, hc_sinkhorn_iters=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
                        pad_token_id=0,
                        tie_word_embeddings=False)
GLM5_NEXT_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                        projection_intermediate_size=16, patch_size=2, temporal_patch_size=2, spatial_merge_size=2)


def tiny_glm5_next(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random Glm5NextForConditionalGeneration with a text-only (flat) config (seeded): hidden 32, 4
    hyper-connection streams (4 Sinkhorn iterations, not 20: per-token work, 16% of the model's time); layers KDA / MLA full indexer / MLA "shared" indexer / KDA, MLPs dense / routed /
    dense / routed; KDA 4 heads of 8, the bounded forget gate (linear_lower_bound -5); MLA 4 heads, q_lora 12, latent
    16, qk head dim 8 (NoPE), v_head_dim 6; indexer 8 heads of 8, pools of 3 tokens, top 9 tokens (3 pools: sparse
    past 12 tokens; a pool straddles every rank boundary not at a multiple of 3); the tiny vision tower (unused: text
    only). KDA gates as `tiny_bailing_hybrid`'s (exp(A_log) from [0.6, 1.6], dt_bias slow on three channels in four);
    the hyper-connections' base and scale, the indexer's pooling gate and position embedding drawn; eager attention
    (transformers' sdpa gives NaN at padded queries, which select nothing), eager experts."""
    import transformers

    config = transformers.Glm5NextConfig(**{**GLM5_NEXT_FIELDS, **overrides}, vision_config=dict(GLM5_NEXT_VISION))
    for cfg in (config, config.text_config):
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Glm5NextForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(5678)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_norm.weight", "kv_a_layernorm.weight", "q_a_layernorm.weight")):
                p.copy_(torch.empty(p.shape).normal_(1, 0.1, generator=gen))
            elif name.endswith(("hc.base", "index_kpool_compress_ape")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("hc.scale"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for layer in model.model.language_model.layers:
            _bounded_gate_(getattr(layer.self_attn, "forget_gate", None), gen)
    return model.to(dtype)


MINIMAX_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def tiny_minimax(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random MiniMaxForCausalLM (seeded): hidden 32, layers lightning / attention / lightning / lightning (8
    heads of d = 8 in both mixers; attention over 2 KV heads, full RoPE), 4 experts top 2; transformers' blocks of
    `block_size` 16 (its inter-block path crosses rank boundaries); residual factors away from 1. The lightning
    decays are the layer's fixed slopes: per token e^{-s} from about 0.6 (layer 0, head 0) to 1 - 5e-8 (layer 3,
    whose slope factor 1 - 3 / (3 + 1e-5) + 1e-5 is 2e-5): the state of one rank matters on the next."""
    import transformers

    fields = dict(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                  layer_types=MINIMAX_LAYERS, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                  num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.25, block_size=16,
                  full_attn_alpha_factor=1.1, full_attn_beta_factor=0.8, linear_attn_alpha_factor=0.9,
                  linear_attn_beta_factor=1.2, mlp_alpha_factor=0.95, mlp_beta_factor=1.3, rms_norm_eps=1e-6,
                  max_position_embeddings=65536, tie_word_embeddings=False, pad_token_id=0)
    config = transformers.MiniMaxConfig(**{**fields, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MiniMaxForCausalLM(config).to(dtype)


def _kernel_fallback_target(obj) -> object | None:
    """The PyTorch function under transformers' hub-kernel wrapper `obj` (`use_kernel_func_from_hub_with_fallback`:
    a function carrying `__wrapped__`, inside a `kernels` Func module where that package is installed), else None."""
    fn = obj
    if isinstance(obj, torch.nn.Module):
        inner = [c.cell_contents for c in getattr(type(obj).forward, "__closure__", None) or ()
                 if inspect.isfunction(c.cell_contents)]
        fn = inner[0] if len(inner) == 1 else None
    if not (inspect.isfunction(fn) and fn.__code__.co_qualname.startswith("use_kernel_func_from_hub_with_fallback.")):
        return None  # not that decorator's wrapper (others carry `__wrapped__` too)
    return fn.__wrapped__


@contextlib.contextmanager
def transformers_torch_paths(model: torch.nn.Module):
    """Run the model's transformers module on its own PyTorch functions while the block runs. Where FLA or
    causal-conv1d are installed, transformers' hub-kernel decorator sends CUDA inputs to them, and their tf32 products
    are no float32 reference. Swaps each module-level function the decorator wrapped for the function it wraps,
    then restores the module."""
    module = sys.modules[type(model).__module__]
    swapped = {n: (f, t) for n, f in vars(module).items() if (t := _kernel_fallback_target(f)) is not None}
    try:
        for name, (_, torch_fn) in swapped.items():
            setattr(module, name, torch_fn)
        yield sorted(swapped)
    finally:
        for name, (fn, _) in swapped.items():
            setattr(module, name, fn)


def indexed_cp_vs_transformers(base, label: str, torch_fn: str, bound: float) -> list[str]:
    """On CUDA, the ranks sharing GPU 0 (float32, no tf32): CP over every rank (eager linear layers,
    full_attention_cp all_gather) against the unmodified transformers model `base` on its own PyTorch functions
    (`transformers_torch_paths`; `torch_fn` must be among those swapped) on the same GPU, for 192 tokens in one row and
    in packed documents (40, 1, 77, 74; transformers run per document): this rank's logits and every parameter
    gradient of sum(logits * w), rank-summed, rel-L2. Prints them on rank 0 after `label`; returns those not under
    `bound`. Collective: every rank calls."""
    from deltacp import parallelize_cp, shard_batch_for_cp

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    base = base.cuda()
    rank, world, S = dist.get_rank(), dist.get_world_size(), 192
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (1, S), generator=gen).cuda()
    w = torch.randn(1, S, base.config.get_text_config().vocab_size, generator=gen).cuda()
    cu = torch.tensor([0, 40, 41, 118, 192])
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    failures = []
    for packed in (False, True):
        ref = copy.deepcopy(base)
        with transformers_torch_paths(ref) as swapped:  # not FLA's kernels (tf32), where the machine has them
            assert torch_fn in swapped, swapped
            if packed:
                b = cu.tolist()
                logits_ref = torch.cat([ref(input_ids=ids[:, x:y], use_cache=False).logits
                                        for x, y in zip(b[:-1], b[1:])], dim=1)
            else:
                logits_ref = ref(input_ids=ids, use_cache=False).logits
            (logits_ref * w).sum().backward()
        model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_backend="eager",
                               full_attention_cp="all_gather")
        batch = shard_batch_for_cp(ids, mesh, cu_seqlens=cu if packed else None, model=model)
        logits = model(**{k: v for k, v in batch.items() if k != "target_ids" and v is not None},
                       use_cache=False).logits
        s = S // world
        (logits * w[:, rank * s:(rank + 1) * s]).sum().backward()
        grads = summed_over_ranks(grads_of(model))
        figures = {"logits": rel_l2(logits, logits_ref[:, rank * s:(rank + 1) * s]),
                   "grads": rel_l2(flat(grads), flat(grads_of(ref)))}
        case = f"{label}, {'packed' if packed else 'row'}"
        if rank == 0:
            print(f"{case}: CP{world} on CUDA vs transformers fp32: " +
                  ", ".join(f"{n} {v:.2e}" for n, v in figures.items()))
        failures += [f"{case}: {n} {v:.2e}" for n, v in figures.items() if not v < bound]
    return failures


LARA_MINI_FIELDS = dict(vocab_size=256, hidden_size=32, num_hidden_layers=4,
                        layer_types=["linear_attention", "sliding_attention", "full_attention", "sliding_attention"],
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24, router_aux_loss_coef=0.25, sliding_window=20,
                        rms_norm_eps=1e-6, eos_token_id=1)


def tiny_lara_mini(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random LaraMiniForCausalLM (seeded): hidden 32; layers GDN, sliding attention, full attention (NoPE),
    sliding attention; GDN 2 key heads for 4 value heads of 8; attention 4 heads of 8 over 2 KV heads, window 20 (at
    CP2 a 64-token row's balanced pieces hold 16 tokens: the halo of 19 reaches back over two pieces); 4 experts top 2
    and the ungated shared expert; tied embeddings (the config's default); slow GDN decays; sdpa attention, eager
    experts."""
    import transformers

    config = transformers.LaraMiniConfig(**{**LARA_MINI_FIELDS, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return long_memory_gates_(transformers.LaraMiniForCausalLM(config)).to(dtype)


LFM2_LAYERS = ["conv", "full_attention", "conv", "conv"]
LFM2_FIELDS = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, layer_types=LFM2_LAYERS,
                   num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, block_auto_adjust_ff_dim=False,
                   max_position_embeddings=65536, norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0)


def tiny_lfm2(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random Lfm2ForCausalLM (seeded): hidden 32; layers conv, attention, conv, conv (gated short conv kernel
    3; attention 4 heads of 8 over 2 KV heads, q/k layernorms, full RoPE); SwiGLU 48; untied head; sdpa attention."""
    import transformers

    config = transformers.Lfm2Config(**{**LFM2_FIELDS, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Lfm2ForCausalLM(config).to(dtype)


LFM3_FIELDS = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                   layer_types=["conv", "sliding_attention", "full_attention", "conv"], num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, conv_L_cache=7, sliding_window=20,
                   max_position_embeddings=65536, norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)


def tiny_lfm3(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random Lfm3ForCausalLM (seeded): hidden 32; layers conv, sliding attention, full attention, conv (gated
    short conv kernel 7, LFM3's: a halo of 6; attention 4 heads of 8 over 2 KV heads, q/k norms, the g_proj gate;
    window 20 with RoPE theta 1e4; the full layer's proportional RoPE theta 1e6, half its frequencies 0: transformers'
    defaults); sandwich norms; SwiGLU 48; untied head; sdpa attention."""
    import transformers

    config = transformers.Lfm3Config(**{**LFM3_FIELDS, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Lfm3ForCausalLM(config).to(dtype)


LFM2_MOE_FIELDS = dict(LFM2_FIELDS, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.3)
LFM2_MOE_FIELDS.pop("block_auto_adjust_ff_dim")


def tiny_lfm2_moe(dtype=torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random Lfm2MoeForCausalLM (seeded): `tiny_lfm2`'s layers; layer 0 dense (SwiGLU 48), layers 1-3 4
    routed experts of 16, top 2, sigmoid router with the expert bias (drawn by `randomize_` in the tables),
    renormalised, scaled 1.3; eager experts."""
    import transformers

    config = transformers.Lfm2MoeConfig(**{**LFM2_MOE_FIELDS, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Lfm2MoeForCausalLM(config).to(dtype)
