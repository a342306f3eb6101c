"""The Triton backend on each family's GDN layer at its released head shapes (one GPU, CP2 over gloo); OLMo-Hybrid
at its config defaults (K = 96, V = 192, beta = 2 sigmoid(b)); the Mamba2 mixers of Bamba, Nemotron-H and
Granite-4.0-H at their transformers config defaults (hidden 4096, 128 heads of 64; Nemotron-H 8 groups of state 128,
the others 1 group of state 256), with Mamba2's initialisation ranges (A from [-16, -1], dt from [1e-3, 1e-1]); the
KDA mixer of Kimi-Linear at its config defaults (Kimi-Linear-48B-A3B: hidden 2304, 32 heads of 128); MiniMax's
lightning attention, Zamba2's Mamba2 mixer and LaRA-mini's GDN at their config defaults (`_config_default_mixer`); the
Mamba1 mixers (the selective scan) of Falcon-Mamba-7B (hidden 4096, I = 8192, N = 16, dt rank 256), Mamba-2.8B (2560,
5120, 16, 160) and Jamba (its config defaults: hidden 4096, I = 8192, N = 16, with the dt / B / C norms), p2p only (one
scan head), and Zamba-7B's (hidden 3712, 2 heads of 3712 channels with their own B and C), ulysses and p2p; 2048
tokens.

For every (family, released model) below, the transformers GDN module of that family (Qwen3_5GatedDeltaNet,
Qwen3_5MoeGatedDeltaNet, Qwen3NextGatedDeltaNet: its own projections, through deltacp's adapter) with the model's
hidden size and linear-attention heads (K = V = 128), bf16, long-memory gates, 4096 tokens, B = 1; two ranks share
the GPU over gloo (as tests/gpu/test_cp_triton.py). Modes ulysses and p2p with the triton backend against the
single-device eager layer in float32 (the reference): output, input gradient, all parameter gradients together
(rank-summed) within bf16 bounds, all finite.

Head shapes (hidden, linear_num_key_heads, linear_num_value_heads), K = V = 128 everywhere: Qwen3-Next-80B-A3B
(transformers' Qwen3NextConfig defaults), Qwen3.5-35B-A3B (2048, 16, 32), Qwen3.5-9B (4096, 16, 32) and Qwen3.5-27B
(5120, 16, 48) match published configs and model cards (the dense ones as deltacp.models.presets); Qwen3.5-122B-A10B
(3072, 16, 64) and Qwen3.5-397B-A17B (4096, 16, 64) match their configs as quoted in public third-party code (not
read from the config.json files themselves; NOTES.md, gaps).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deltacp import LinearAttentionContextParallel
from deltacp.distributed.launch import run_distributed
from helpers import flat, grads_of, local_slice, long_memory_gates_, rel_l2, summed_over_ranks, tiny_text_fields

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (Triton backend at released head shapes)")

SEQ = 4096
BF16_BOUND = 2e-2  # bf16 projections and kernels against an fp32 layer (as test_cp_triton.py)
SHAPES = {  # model: (family module class, hidden, key heads, value heads)
    "Qwen3.5-9B": ("qwen3_5", 4096, 16, 32),
    "Qwen3.5-27B": ("qwen3_5", 5120, 16, 48),
    "Qwen3.5-35B-A3B": ("qwen3_5_moe", 2048, 16, 32),
    "Qwen3.5-122B-A10B": ("qwen3_5_moe", 3072, 16, 64),
    "Qwen3.5-397B-A17B": ("qwen3_5_moe", 4096, 16, 64),
    "Qwen3-Next-80B-A3B": ("qwen3_next", 2048, 16, 32),
    # transformers' OlmoHybridConfig defaults (hidden 3840, 30 key and value heads, K = 96, V = 192; beta = 2 sigmoid(b))
    "OLMo-Hybrid (config defaults)": ("olmo_hybrid", 3840, 30, 30, 96, 192),
    # Mamba2 mixers at their config defaults (hidden, heads, groups, state: from the config class)
    "Bamba (config defaults)": ("bamba", None, None, None),
    "Nemotron-H (config defaults)": ("nemotron_h", None, None, None),
    "Granite-4.0-H (config defaults)": ("granite_hybrid", None, None, None),
    # KDA at Kimi-Linear-48B-A3B's shape (KimiLinearConfig's defaults: hidden 2304, 32 heads of 128)
    "Kimi-Linear (config defaults)": ("kimi_linear", None, None, None),
    # the mixers of issue 53's families at their config defaults: MiniMax's lightning attention (hidden 4096, 32 heads
    # of 128: the scalar-decay kernels with one B/C group per head, G = H), Zamba2's Mamba2 (hidden 2560, dt clamped,
    # gate before the norm), LaRA-mini's GDN (hidden 1024, 8 key heads for 16 value heads of 128, fp32 gated norm)
    "MiniMax-Text-01 (config defaults)": ("minimax", None, None, None),
    "Zamba2 (config defaults)": ("zamba2", None, None, None),
    "LaRA-mini (config defaults)": ("lara_mini", None, None, None),
    # Mamba1 mixers (the selective scan, one head of I x N state rows: p2p only) at released shapes (hidden, I,
    # time_step_rank; N = 16)
    "Falcon-Mamba-7B": ("falcon_mamba", 4096, 8192, 256),
    "Mamba-2.8B": ("mamba", 2560, 5120, 160),
    "Jamba (config defaults)": ("jamba", None, None, None),
    # Zamba-7B's Mamba mixer (ZambaConfig's defaults: hidden 3712, 2 heads of 3712 channels, N = 16, B and C per
    # head: one scan of the kernels per head), ulysses (a head a rank) and p2p
    "Zamba (config defaults)": ("zamba", None, None, None),
}
MAMBA1_SEQ = 2048  # each rank's float32 eager reference holds several [T, I, N] tensors (I = 8192: 1 GiB each)
MAMBA1 = ("mamba", "falcon_mamba", "jamba", "zamba")
MAMBA2 = {  # family: (config class, module path, mixer class)
    "bamba": ("BambaConfig", "bamba.modeling_bamba", "BambaMixer"),
    "nemotron_h": ("NemotronHConfig", "nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
    "granite_hybrid": ("GraniteMoeHybridConfig", "granitemoehybrid.modeling_granitemoehybrid",
                       "GraniteMoeHybridMambaLayer"),
}


def _kda():
    """Kimi-Linear's KDA mixer at its config defaults, slowly decaying per-channel gates (`long_memory_gates_`)."""
    import transformers
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = transformers.KimiLinearConfig()
    return long_memory_gates_(KimiLinearDeltaAttention(config, 0)), config.hidden_size


def _mamba2(family):
    """The family's Mamba2 mixer at its config defaults, A and dt drawn from Mamba2's initialisation ranges."""
    import importlib
    import math

    import transformers

    config_cls, path, cls = MAMBA2[family]
    config = getattr(transformers, config_cls)()
    module = getattr(importlib.import_module(f"transformers.models.{path}"), cls)(config, 0)
    with torch.no_grad():
        heads = module.num_heads
        module.A_log.copy_(torch.empty(heads).uniform_(0, math.log(16)))
        dt = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1)))
        module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
    return module, config.hidden_size


def _mamba1(family, hidden, inter, rank):
    """The family's Mamba1 mixer (Jamba: at JambaConfig's defaults, hidden 4096, I = 8192, with its dt / B / C
    norms), A = -(1..16) per channel and D = 1 (Mamba1's initialisation) and dt from Mamba1's initial range
    [1e-3, 1e-1] through dt_proj's bias."""
    import importlib
    import math

    import transformers

    if family == "jamba":
        config = transformers.JambaConfig()
        module = transformers.models.jamba.modeling_jamba.JambaMambaMixer(config, 1)
    elif family == "zamba":
        config = transformers.ZambaConfig()
        module = transformers.models.zamba.modeling_zamba.ZambaMambaMixer(config, 0)
    else:
        prefix = {"mamba": "Mamba", "falcon_mamba": "FalconMamba"}[family]
        config = getattr(transformers, f"{prefix}Config")(hidden_size=hidden, intermediate_size=inter, state_size=16,
                                                          time_step_rank=rank, conv_kernel=4)
        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), f"{prefix}Mixer")
        # FalconMambaMixer's own initialisation reads its norms before making them (transformers 5.25): skipped
        # where the constructor has the switch
        try:
            module = cls(config, 0, initialize_mixer_weights=False)
        except TypeError:
            module = cls(config, 0)
    with torch.no_grad():
        inter, n = module.intermediate_size, module.ssm_state_size
        # (Zamba: A_log, D and the dt bias per head, [heads, I / heads, ...]: the same values reshaped)
        a_log = torch.arange(1, n + 1, dtype=torch.float32).log().expand(inter, n)
        module.A_log.copy_(a_log.reshape(module.A_log.shape))
        module.D.fill_(1.0)
        dt = torch.exp(torch.empty(inter).uniform_(math.log(1e-3), math.log(1e-1)))
        bias = module.dt_proj_bias if family == "zamba" else module.dt_proj.bias
        bias.copy_((dt + torch.log(-torch.expm1(-dt))).reshape(bias.shape))  # softplus(bias) = dt
    return module, config.hidden_size


def _config_default_mixer(family):
    """The mixer of an issue-53 family at its config defaults (MiniMax: a middle layer's fixed slopes, per token
    e^-s from about 0.6 down to 1 - 2e-3; Zamba2: Mamba2's initialisation ranges as `_mamba2`; LaRA-mini: slowly
    decaying gates)."""
    import math

    import transformers

    if family == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

        config = transformers.MiniMaxConfig()
        return MiniMaxLightningAttention(config, config.num_hidden_layers // 2), config.hidden_size
    if family == "zamba2":
        from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

        config = transformers.Zamba2Config(n_mamba_heads=80)  # Zamba2-2.7B's 80 heads of 64 (the default: 8 of 640)
        module = Zamba2MambaMixer(config, 0)
        with torch.no_grad():
            module.A_log.copy_(torch.empty(module.num_heads).uniform_(0, math.log(16)))
            dt = torch.exp(torch.empty(module.num_heads).uniform_(math.log(1e-3), math.log(1e-1)))
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        return module, config.hidden_size
    from transformers.models.lara_mini.modeling_lara_mini import LaraMiniGatedDeltaNet

    config = transformers.LaraMiniConfig()
    return long_memory_gates_(LaraMiniGatedDeltaNet(config, 0)), config.hidden_size


def _gdn(family, hidden, hk, hv, k_dim=128, v_dim=128):
    import transformers

    fields = tiny_text_fields(hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
                              linear_key_head_dim=k_dim, linear_value_head_dim=v_dim)
    match family:
        case "olmo_hybrid":
            for key in ("head_dim",):
                fields.pop(key)
            config, cls = transformers.OlmoHybridConfig(**fields, pad_token_id=0, eos_token_id=1), "OlmoHybridGatedDeltaNet"
            module = transformers.models.olmo_hybrid.modeling_olmo_hybrid
        case "qwen3_5":
            config, cls = transformers.Qwen3_5TextConfig(**fields), "Qwen3_5GatedDeltaNet"
            module = transformers.models.qwen3_5.modeling_qwen3_5
        case "qwen3_5_moe":
            fields.pop("intermediate_size")
            config, cls = transformers.Qwen3_5MoeTextConfig(**fields), "Qwen3_5MoeGatedDeltaNet"
            module = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
        case "qwen3_next":
            config, cls = transformers.Qwen3NextConfig(**fields), "Qwen3NextGatedDeltaNet"
            module = transformers.models.qwen3_next.modeling_qwen3_next
    return long_memory_gates_(getattr(module, cls)(config, 0))


def _run(module, x, d_out):
    x = x.clone().requires_grad_()
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out  # MiniMax's lightning attention returns (output, None)
    (out.float() * d_out).sum().backward()
    return out.detach().float(), x.grad.float()


def family_shapes_worker(rank, world, name):
    torch.cuda.set_device(0)
    self_group = None
    for r in range(world):
        group = dist.new_group([r])
        if r == rank:
            self_group = group
    single = DeviceMesh.from_group(self_group, "cuda", mesh_dim_names=("cp",))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    failures, rows = [], []
    for family, hidden, hk, hv, *dims in [SHAPES[name]]:
        torch.manual_seed(0)
        modes, seq = ("ulysses", "p2p"), SEQ
        if family in MAMBA1:  # Ulysses: Mamba1's channels split, x_proj summed; Zamba's heads split
            (base, hidden), seq = _mamba1(family, hidden, hk, hv), MAMBA1_SEQ
            base = base.cuda()
        elif family in MAMBA2 or family == "kimi_linear":
            base, hidden = _mamba2(family) if family in MAMBA2 else _kda()
            base = base.cuda()
        elif family in ("minimax", "zamba2", "lara_mini"):
            base, hidden = _config_default_mixer(family)
            base = base.cuda()
        else:
            base = _gdn(family, hidden, hk, hv, *dims).cuda()
        x = torch.randn(1, seq, hidden, device="cuda")
        d_out = torch.randn(1, seq, hidden, device="cuda")
        ref = LinearAttentionContextParallel(mode="p2p", backend="eager").apply(copy.deepcopy(base).float(), single)
        out_ref, dx_ref = _run(ref, x, d_out)
        grads_ref = grads_of(ref)
        for mode in modes:
            cp = LinearAttentionContextParallel(mode=mode, backend="triton").apply(
                copy.deepcopy(base).to(torch.bfloat16), mesh)
            out, dx = _run(cp, local_slice(x, rank, world).to(torch.bfloat16), local_slice(d_out, rank, world))
            grads = summed_over_ranks({n: g.float() for n, g in grads_of(cp).items()})
            checks = {"output": rel_l2(out, local_slice(out_ref, rank, world)),
                      "input grad": rel_l2(dx, local_slice(dx_ref, rank, world)),
                      "param grads": rel_l2(flat(grads), flat(grads_ref))}
            finite = all(torch.isfinite(t).all() for t in (out, dx, flat(grads)))
            rows.append(f"{name:20s} {family:12s} {mode:8s} " + " ".join(f"{k} {v:.2e}" for k, v in checks.items()))
            failures += [f"{name} {mode} {k}: {v:.2e}" for k, v in checks.items() if not v < BF16_BOUND]
            if not finite:
                failures.append(f"{name} {mode}: non-finite values")
            del cp
        del ref, base
        torch.cuda.empty_cache()
    if rank == 0:
        print("\n" + "\n".join(rows))
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_on_released_family_head_shapes(name):
    run_distributed(family_shapes_worker, 2, name, timeout_s=600)
