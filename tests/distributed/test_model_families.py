"""Model families under CP on gloo, float64, with their auxiliary losses and images: Qwen3.5 MoE, Qwen3-Next,
multimodal Qwen3.5 (dense and MoE) with images crossing rank boundaries, a text-only batch through a multimodal model,
Granite-4.0-H (Mamba2 with routed experts: its aux loss read from `num_local_experts`), MiniMax-Text-01 (lightning
attention, its experts' aux loss read from `num_local_experts`), Jamba (Mamba1, NoPE GQA, experts not renormalised:
its aux loss read from `num_experts`), and multimodal Qwen4-Exp at CP2
(indexed attention with full_attention_cp="all_gather", 64-token rows past the indexer's budget; a PLE layer whose
n-grams read the image tokens' ids, as transformers hands them; with images in every mode, and text only).

Per class (tiny random configs as transformers builds them: hidden 32, 3 GDN + 1 full attention layers, 4
experts top-2, a one-block vision tower), one spawned run per world size checks:
- deltacp's single-device computation (one-rank mesh) against the unmodified transformers model, float32
  accuracy: logits, the loss (cross entropy + router_aux_loss_coef * aux_loss, as transformers forms it with
  labels), the auxiliary loss, all gradients together (transformers computes norms, gates, its GDN fallback and
  the aux-loss sums in float32 even in a float64 model);
- CP in every mode against that single-device computation, 1e-8: this rank's logits, the loss, the aux loss
  (global token statistics over the CP group), all gradients summed over ranks together, the grad norm;
- FSDP2 on top (one MoE case), gradients as DTensors.
Mutation seen failing: the multimodal hook handing Qwen4-Exp's PLE the image tokens' ids clamped to 240 (single
device against transformers: logits 0.48, gradients 0.58).
"""

import copy

import pytest
import torch

from deltacp import all_reduce_cp_grads, cp_cross_entropy, fully_shard_qwen3_5, parallelize_cp, shard_batch_for_cp
from deltacp.distributed.launch import run_distributed
from helpers import (TEXT_VOCAB, cp_mesh, flat, full_tensors, grads_of, image_batch, local_slice, rel_l2, self_meshes,
                     tiny_family_model)

MODES = ("ulysses", "p2p", "all_gather")
S = 64  # 32 / 16 local tokens at CP2 / CP4


def _batch(name, world):
    """Global inputs of one case: ids [B, S], padding mask or None, mm_token_type_ids or None, image kwargs."""
    if name.endswith("ConditionalGeneration"):
        # images whose tokens cross rank boundaries (CP4: 16, 32, 48; CP2: 32), in row 0 only
        ids, types, pixel_values, grid = image_batch(2, S, starts=(14, 30), seed=1)
        return ids, None, types, dict(pixel_values=pixel_values, image_grid_thw=grid)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, TEXT_VOCAB, (2, S), generator=gen)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, 45:] = 0  # right padding: the aux loss counts valid tokens only
    return ids, mask, None, {}


def _step(model, mesh, ids, mask, types, images, moe, coef, fsdp=False):
    batch = shard_batch_for_cp(ids, mesh, attention_mask=mask, mm_token_type_ids=types)
    inputs = {k: v for k, v in batch.items() if k != "target_ids" and v is not None}
    extra = dict(output_router_logits=True) if moe else {}
    out = model(**inputs, **images, **extra, use_cache=False)
    loss = cp_cross_entropy(out.logits, batch["target_ids"], mesh)
    aux = out.aux_loss if moe else torch.zeros((), dtype=loss.dtype)
    (loss + coef * aux).backward()
    if fsdp:
        grads = full_tensors({n: p.grad for n, p in model.named_parameters()})
    else:
        all_reduce_cp_grads(model, mesh)
        grads = grads_of(model)
    return out.logits.detach(), (loss + coef * aux).detach(), aux.detach(), grads


def families_worker(rank, world, cases):
    single_mesh, mesh = self_meshes(), cp_mesh()
    failures = []
    for name, modes, fsdp_mode, text_only in cases:
        torch.manual_seed(0)
        base = tiny_family_model(name)
        ids, mask, types, images = _batch(name, world)
        if text_only:
            types, images = None, {}
        text_cfg = base.config.get_text_config()  # routed experts with an auxiliary loss, by the config's own names
        moe = (getattr(text_cfg, "num_experts", 0) or getattr(text_cfg, "num_local_experts", 0)) > 0
        coef = text_cfg.router_aux_loss_coef if moe else 0.0
        tag = f"{name}{' text-only' if text_only else ''}"

        # transformers, unmodified (labels: padding ignored; with output_router_logits the loss includes the aux)
        tf = copy.deepcopy(base)
        labels = ids if mask is None else torch.where(mask.bool(), ids, -100)
        tf_inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **images)
        if types is not None:
            tf_inputs["mm_token_type_ids"] = types
        out_tf = tf(**tf_inputs, **(dict(output_router_logits=True) if moe else {}))
        out_tf.loss.backward()

        # Qwen4-Exp's indexed attention layers run with full_attention_cp="all_gather" only
        full = dict(full_attention_cp="all_gather") if name.startswith("Qwen4Exp") else {}
        ref = parallelize_cp(copy.deepcopy(base), single_mesh, linear_attention_cp_mode="p2p", **full)
        logits_ref, loss_ref, aux_ref, grads_ref = _step(ref, single_mesh, ids, mask, types, images, moe, coef)
        valid = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
        checks = {"logits": rel_l2(logits_ref[valid], out_tf.logits[valid]),
                  "loss": abs(loss_ref / out_tf.loss - 1).item(),
                  "all grads": rel_l2(flat(grads_ref), flat(grads_of(tf)))}
        if moe:
            checks["aux loss"] = abs(aux_ref / out_tf.aux_loss - 1).item()
        bounds = {"all grads": 1e-4}
        failures += [f"{tag} single vs transformers {k}: {v:.2e}" for k, v in checks.items()
                     if not v < bounds.get(k, 1e-6)]

        for mode in modes:
            for fsdp in (False, True) if mode == fsdp_mode else (False,):
                cp = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode, **full)
                if fsdp:
                    fully_shard_qwen3_5(cp, mesh)
                logits, loss, aux, grads = _step(cp, mesh, ids, mask, types, images, moe, coef, fsdp)
                checks = {"logits": rel_l2(logits, local_slice(logits_ref, rank, world)),
                          "loss": abs(loss / loss_ref - 1).item(),
                          "all grads": rel_l2(flat(grads), flat(grads_ref)),
                          "grad norm": abs(flat(grads).norm().item() / flat(grads_ref).norm().item() - 1)}
                if moe:
                    checks["aux loss"] = abs(aux / aux_ref - 1).item()
                failures += [f"{tag} CP{world} {mode} fsdp={fsdp} {k}: {v:.2e}" for k, v in checks.items()
                             if not v < 1e-8]
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


CP4_CASES = [
    ("Qwen3_5MoeForCausalLM", MODES, "p2p", False),
    ("Qwen3NextForCausalLM", MODES, None, False),
    ("Qwen3_5ForConditionalGeneration", MODES, None, False),
    ("Qwen3_5MoeForConditionalGeneration", ("p2p",), None, False),
    ("Qwen3_5ForConditionalGeneration", ("ulysses",), None, True),
]
CP2_CASES = [(name, MODES, None, False) for name in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM",
                                                     "Qwen3_5ForConditionalGeneration",
                                                     "Qwen3_5MoeForConditionalGeneration")]
CP2_CASES.append(("GraniteMoeHybridForCausalLM", MODES, "p2p", False))  # Mamba2 + routed experts, FSDP2 on p2p
CP2_CASES.append(("MiniMaxForCausalLM", MODES, None, False))  # lightning attention + routed experts (its aux loss)
CP2_CASES.append(("LaraMiniForCausalLM", ("all_gather",), None, False))  # sliding layers under the global aux loss
# Mamba1 with the dt / B / C norms + routed experts (not renormalised): the global aux loss
CP2_CASES.append(("JambaForCausalLM", ("p2p",), None, False))
# Qwen4-Exp's multimodal model (indexed attention, full_attention_cp="all_gather"; a PLE layer reading the image
# tokens' ids), with images and text only
CP2_CASES += [("Qwen4ExpForConditionalGeneration", MODES, None, False),
              ("Qwen4ExpForConditionalGeneration", ("p2p",), None, True)]


@pytest.mark.parametrize("world,cases", [(4, CP4_CASES), (2, CP2_CASES)])
def test_model_families(world, cases):
    run_distributed(families_worker, world, cases, timeout_s=900)
