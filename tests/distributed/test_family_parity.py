"""Every supported family under CP on gloo, float64, in what the conformance tables (tests/conformance: every config
knob, every mode and layout, padded, packed and long rows, at CP2 and CP4) do not run: FSDP2 + activation
checkpointing at CP2, the p2p scan and the 2-D layout at CP4, and CP8 on packed rows (OLMo-Hybrid in every mode, one
family of each other mixer kind once, LaRA-mini's sliding window on packed and padded rows).

Models (tiny, as transformers builds them; slowly decaying gates, so that the state of one rank matters on the next):
- OLMo-Hybrid (`tiny_olmo_hybrid`): hidden 32, layers [GDN, attention, GDN, GDN], 2 key heads serving 8 value heads
  of K = 12, V = 24, beta = 2 sigmoid(b) reaching 2, attention with full-width q/k norms, GQA, with RoPE or NoPE;
- Qwen3.5 dense, Qwen3.5 MoE, Qwen3-Next (`tiny_family_model`, 8 value heads and 8 attention heads so that Ulysses
  runs at CP8), Bamba, Nemotron-H, Granite-4.0-H and Falcon-H1 (Mamba2: 8 heads in 2 groups, conv with bias, the D
  skip, their MLP / MoE blocks and muP multipliers), Kimi-Linear and Bailing-Hybrid (KDA with per-channel gates, MLA
  with v_head_dim != qk head dim, routed and shared experts), MiniMax-Text-01 (`tiny_minimax`: lightning attention,
  the scalar-decay recurrence without a conv and with fixed per-layer slopes; the normed-input residual; experts);
- Mamba2 (`tiny_mamba2`): Mamba2 blocks only (no attention, no MLP): its context reaches the layers by pre-hooks;
- LaRA-mini (`tiny_lara_mini`): GDN, sliding-window attention (window 20, RoPE) and NoPE full attention, routed and
  ungated shared experts; at CP8 its window reaches back over several pieces;
- LFM2 and LFM2-MoE (`tiny_lfm2`, `tiny_lfm2_moe`): gated short convs (no recurrence: the kernel - 1 halo only) and
  GQA with q/k layernorms; LFM2-MoE's sigmoid router with the expert bias; LFM3 (`tiny_lfm3`): kernel-7 convs,
  sliding-window and full attention with per-head sigmoid gates and sandwich norms;
- Mamba, FalconMamba, Jamba (Mamba1's selective scan: a head per channel, x_proj summed where they split); Zamba2
  (`tiny_zamba2`): Mamba2 layers and shared attention blocks tied across invocations (one parameter set under FSDP2); RecurrentGemma
  (`tiny_recurrent_gemma`: the RG-LRU behind a conv halo, local attention, soft-capped logits: in the fused loss's
  kernels);
- rows right-padded ("padded") against the unmodified model at their valid tokens (left padding: the tables).

References:
- the unmodified transformers model (per document for packed rows: transformers ignores the packing keywords),
  float32 accuracy (its norms, gates and GDN fallback compute in float32 even in a float64 model);
- deltacp's single-device computation (one-rank mesh), CP against it at 1e-8: this rank's logits, the loss, every
  parameter gradient summed over ranks, the grad norm. Both sides run under `float64_upcasts` (transformers'
  float32 casts widened alike), so they differ by float64 rounding only;
- the fused head ops on the single device (no logits: a family's logit scale and soft-cap reach their kernels through
  the hidden states): `cp_causal_lm_loss` against the logits' loss and `cp_token_logprobs` against log_softmax of the
  logits at the valid targets, 1e-12.
"""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from deltacp import (
    IGNORE_INDEX,
    all_reduce_cp_grads,
    cp_causal_lm_loss,
    cp_token_logprobs,
    apply_activation_checkpointing,
    cp_cross_entropy,
    fully_shard_cp,
    parallelize_cp,
    shard_batch_for_cp,
)
from deltacp.distributed.launch import run_distributed
from helpers import (computed_once, cp_mesh, flat, float64_upcasts, full_tensors, grads_of, rel_l2, self_meshes,
                     tiny_family_model)

WIDE = dict(linear_num_value_heads=8, num_attention_heads=8)  # heads that divide CP8 (Ulysses)


def _model(name):
    torch.manual_seed(0)
    return tiny_family_model(name, **({} if name.startswith("Olmo") else WIDE))

S = 64
LENGTHS = [1, 3, 20, 7, 33]  # packed row: documents shorter than the conv kernel, crossing rank boundaries


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())


def _transformers(model, ids, mask, cu):
    """The unmodified model: logits and the mean next-token loss (per document for a packed row)."""
    if cu is None:
        labels = ids if mask is None else torch.where(mask.bool(), ids, -100)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        return out.logits, out.loss
    bounds = cu.tolist()
    logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits
                        for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    total = sum(F.cross_entropy(logits[0, a:b - 1], ids[0, a + 1:b], reduction="sum")
                for a, b in zip(bounds[:-1], bounds[1:]) if b - a > 1)
    return logits, total / sum(b - a - 1 for a, b in zip(bounds[:-1], bounds[1:]) if b - a > 1)


def _step(model, mesh, ids, mask, cu, fsdp=False):
    batch = shard_batch_for_cp(ids, mesh, attention_mask=mask, cu_seqlens=cu, model=model)
    with float64_upcasts():
        logits = model(**{k: v for k, v in batch.items() if k != "target_ids" and v is not None},
                       use_cache=False).logits
        loss = cp_cross_entropy(logits, batch["target_ids"], mesh)
        loss.backward()
    if fsdp:
        grads = full_tensors({n: p.grad for n, p in model.named_parameters()})
    else:
        all_reduce_cp_grads(model, mesh)
        grads = grads_of(model)
    return logits.detach(), loss.detach(), flat(grads)


def family_worker(rank, world, cases):
    single_mesh, mesh = self_meshes(), cp_mesh()
    failures = []
    gen = torch.Generator().manual_seed(3)
    padded_ids = torch.randint(0, 256, (2, S), generator=gen)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, 45:] = 0
    packed_ids = torch.randint(0, 256, (1, sum(LENGTHS)), generator=gen)
    batches = {"padded": (padded_ids, mask, None),
               "packed": (packed_ids, None, _cu(LENGTHS))}

    def reference(name, kind):
        base = _model(name)
        ids, m, cu = batches[kind]
        tf = copy.deepcopy(base)
        logits_tf, loss_tf = _transformers(tf, ids, m, cu)
        loss_tf.backward()
        ref = parallelize_cp(copy.deepcopy(base), single_mesh, linear_attention_cp_mode="p2p")
        # the fused CP loss (no logits; a family's logit scale through the hidden states) on another copy
        fused_model = parallelize_cp(copy.deepcopy(base), single_mesh, linear_attention_cp_mode="p2p")
        batch = shard_batch_for_cp(ids, single_mesh, attention_mask=m, cu_seqlens=cu, model=fused_model)
        targets = batch.pop("target_ids")
        inputs = {k: v for k, v in batch.items() if v is not None}
        with float64_upcasts(), torch.no_grad():  # (RecurrentGemma: the logits' soft-cap in the loss's kernels)
            fused = cp_causal_lm_loss(fused_model, targets, single_mesh, use_cache=False, **inputs)
            logprobs = cp_token_logprobs(fused_model, targets, single_mesh, use_cache=False, **inputs)
        step = _step(ref, single_mesh, ids, m, cu)
        # cp_token_logprobs against log_softmax of the single device's logits at the valid targets (the family's logit
        # scale and soft-cap reach its kernels through the hidden states, as the fused loss's)
        valid = targets != IGNORE_INDEX
        expected = torch.log_softmax(step[0].double(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        lp_err = ((logprobs[valid] - expected[valid]).abs().max() / expected[valid].abs().max()).item()
        return logits_tf.detach(), loss_tf.detach(), flat(grads_of(tf)), step, (fused, lp_err)

    keys = sorted({(name, kind) for name, kind, *_ in cases})
    refs = dict(zip(keys, computed_once(*(partial(reference, *key) for key in keys))))
    checked, worst = set(), {}
    for name, kind, mode, layout, extra in cases:
        tag = f"{name} {kind} CP{world} {mode} {layout} {extra or ''}"
        ids, m, cu = batches[kind]
        logits_tf, loss_tf, grads_tf, (logits_ref, loss_ref, grads_ref), (fused, lp_err) = refs[(name, kind)]
        if (name, kind) not in checked:  # deltacp's single-device path against the unmodified model
            checked.add((name, kind))
            valid = torch.ones(ids.shape, dtype=torch.bool) if m is None else m.bool()
            checks = {"logits": rel_l2(logits_ref[valid], logits_tf[valid]), "loss": abs(loss_ref / loss_tf - 1).item(),
                      "grads": rel_l2(grads_ref, grads_tf)}
            checks["fused loss"] = abs(fused / loss_ref - 1).item()  # cp_causal_lm_loss against the logits' loss
            checks["fused logprobs"] = lp_err
            bounds = {"logits": 1e-6, "loss": 1e-6, "grads": 1e-4, "fused loss": 1e-12, "fused logprobs": 1e-12}
            failures += [f"{tag} single vs transformers {k}: {v:.2e}" for k, v in checks.items() if not v < bounds[k]]
        settings = dict(linear_attention_cp_mode=mode, sequence_layout=layout)
        if extra == "scan":
            settings["linear_attention_state_passing"] = "scan"
        if extra == "2d":
            settings.update(ulysses_degree=2, full_attention_cp="all_gather")
        if mode != "ulysses" and extra != "2d":
            settings["full_attention_cp"] = "ring" if layout == "balanced" else "all_gather"
        model = parallelize_cp(_model(name), mesh, **settings)
        fsdp = extra == "fsdp+checkpointing"
        if fsdp:
            apply_activation_checkpointing(model)
            fully_shard_cp(model, mesh)
        logits, loss, grads = _step(model, mesh, ids, m, cu, fsdp)
        batch = shard_batch_for_cp(torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1), mesh, model=model,
                                   cu_seqlens=cu)
        mine = batch["input_ids"][0]  # this rank's row positions (a packed row may be padded: positions >= S)
        kept = mine < ids.shape[1]
        checks = {"logits": rel_l2(logits[:, kept], logits_ref[:, mine[kept]]),
                  "loss": abs(loss / loss_ref - 1).item(), "grads": rel_l2(grads, grads_ref),
                  "grad norm": abs(grads.norm().item() / grads_ref.norm().item() - 1)}
        failures += [f"{tag} {k}: {v:.2e}" for k, v in checks.items() if not v < 1e-8]
        for k, v in checks.items():
            worst[k] = max(worst.get(k, 0.0), v)
    if rank == 0:  # the tightest margins (pytest -s shows them)
        print(f"CP{world}, {len(cases)} cases, worst against the single-device path: "
              + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _cases(modes, layouts, kinds, names=("OlmoHybridForCausalLM",), extra=None):
    return [(name, kind, mode, layout, extra) for name in names for kind in kinds for mode in modes
            for layout in layouts]


MODES = ("ulysses", "p2p", "all_gather")
LAYOUTS = ("contiguous", "balanced")
OLMO = ("OlmoHybridForCausalLM", "OlmoHybridForCausalLM-nope")
OTHERS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "BambaForCausalLM",
          "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "KimiLinearForCausalLM",
          "BailingHybridForCausalLM")
# every mode, layout and input of each family at CP2 and CP4, with every config knob, is the conformance tables'
# (tests/conformance); here what they do not run: FSDP2 + activation checkpointing, the p2p scan, the 2-D layout, CP8
CP2 = _cases(("p2p",), ("contiguous",), ("padded",), extra="fsdp+checkpointing",
             names=("OlmoHybridForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
                    "FalconH1ForCausalLM", "KimiLinearForCausalLM", "BailingHybridForCausalLM",
                    "MiniMaxForCausalLM", "LaraMiniForCausalLM", "Lfm2MoeForCausalLM", "Mamba2ForCausalLM",
                    "MambaForCausalLM", "JambaForCausalLM",
                    "Zamba2ForCausalLM", "Lfm3ForCausalLM", "ZambaForCausalLM",
                    "RecurrentGemmaForCausalLM"))
CP4 = (_cases(("p2p",), LAYOUTS, ("packed",), extra="scan")
       + _cases(("p2p", "all_gather"), ("contiguous", "balanced"), ("padded",), extra="2d")
       # LaRA-mini's sliding layers keep their K/V halo over the whole CP group in the 2-D layout
       + _cases(("p2p",), ("balanced",), ("padded",), names=("LaraMiniForCausalLM",), extra="2d")
       # Zamba's 2 Mamba heads, one a Ulysses group member, across the groups by p2p
       + _cases(("p2p",), ("balanced",), ("packed",), names=("ZambaForCausalLM",), extra="2d")
       # Jamba's Mamba1 channels split over Ulysses groups of 2 (x_proj's partial products summed in each), its
       # states across the groups by all_gather
       + _cases(("all_gather",), ("contiguous",), ("padded",), names=("JambaForCausalLM",), extra="2d")
       # RecurrentGemma: the RG-LRU's gate blocks split over Ulysses groups of 2, its states by the p2p scan
       + [("RecurrentGemmaForCausalLM", "padded", "all_gather", "contiguous", "2d"),
          ("RecurrentGemmaForCausalLM", "packed", "p2p", "balanced", "scan")])
CP8_OTHERS = ("Qwen3NextForCausalLM", "BambaForCausalLM", "FalconH1ForCausalLM", "KimiLinearForCausalLM",
              "MiniMaxForCausalLM", "Mamba2ForCausalLM")
CP8 = (_cases(MODES, ("contiguous",), ("packed",))  # OLMo-Hybrid in every mode; one family of each other mixer, in turn
       + [(name, "packed", ("ulysses", "p2p", "all_gather")[i % 3], ("balanced", "contiguous")[i % 2], None)
          for i, name in enumerate(CP8_OTHERS)]
       + _cases(("p2p",), ("balanced",), ("padded",), extra="scan")
       # LaRA-mini's window of 20 over pieces of 4 (balanced) and 8 tokens: the K/V halo reaches back 5 and 3 pieces
       + [("LaraMiniForCausalLM", "packed", "ulysses", "balanced", None),
          ("LaraMiniForCausalLM", "padded", "all_gather", "contiguous", None),
          # LFM2's gated short conv (halo 2) over pieces of 4 (balanced): each from its holder
          ("Lfm2ForCausalLM", "packed", "p2p", "balanced", None),
          # Mamba1's selective scan: its 32 channels over 8 ranks by Ulysses (x_proj's partial products summed over
          # all 8), and over pieces of 8 tokens by all_gather
          ("MambaForCausalLM", "packed", "ulysses", "balanced", None),
          ("FalconMambaForCausalLM", "packed", "all_gather", "contiguous", None),
          # Jamba: Mamba1 with the dt / B / C norms, NoPE attention and routed experts, over pieces of 4 tokens
          ("JambaForCausalLM", "packed", "all_gather", "balanced", None),
          # Zamba2's shared blocks (tied across invocations) under Ulysses, over pieces of 4 tokens
          ("Zamba2ForCausalLM", "packed", "ulysses", "balanced", None),
          # Zamba's Mamba1 heads and its one shared block, a left-padded row, over pieces of 4 tokens
          ("ZambaForCausalLM", "padded", "p2p", "balanced", None),
          # LFM3: the conv halo of 6 and the window of 20 over pieces of 8 tokens (balanced pieces of 4 would be
          # shorter than the conv halo: refused, the error says to pad)
          ("Lfm3ForCausalLM", "packed", "p2p", "contiguous", None),
          # RecurrentGemma: the RG-LRU's resets at global position 0, the conv halo of 3 and the window of 20 over
          # pieces of 4 tokens
          ("RecurrentGemmaForCausalLM", "packed", "all_gather", "balanced", None)])


@pytest.mark.parametrize("world,cases", [(2, CP2), (4, CP4), (8, CP8)])
def test_family_parity(world, cases):
    run_distributed(family_worker, world, cases, timeout_s=1200)
