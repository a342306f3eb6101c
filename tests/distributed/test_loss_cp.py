"""The head ops under CP4 (gloo, one spawn).

cp_linear_cross_entropy: the value on every rank and the rank-summed gradients are the single-device ones (float64,
1e-12), one rank's targets all ignored; in the whole model (FSDP2 on the same mesh, tied embeddings)
`cp_causal_lm_loss` against the single-device model with full logits.

cp_token_logprobs (float64 model): each rank's log-probabilities and entropy equal its slice (in its sequence
layout) of log_softmax(logits / T) of the single-device model's full logits (1e-10), and the parameter gradients
of sum(w * logp + u * entropy) for random per-token w, u, summed over ranks, equal the single-device ones (1e-8):
both sequence layouts, unpacked rows (B = 2) and a packed row (documents crossing ranks), FSDP2 and activation
checkpointing, tied embeddings, temperatures 0.7 / 1 / 1.3.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM

from deltacp import (
    all_reduce_cp_grads,
    apply_activation_checkpointing,
    cp_causal_lm_loss,
    cp_cross_entropy,
    cp_linear_cross_entropy,
    cp_token_logprobs,
    fully_shard_cp,
    fully_shard_qwen3_5,
    parallelize_cp,
    parallelize_qwen3_5_cp,
    shard_batch_for_cp,
)
from deltacp.distributed.launch import run_distributed
from helpers import (cp_mesh, flat, full_tensors, grads_of, local_slice, long_memory_gates_, rel_l2, self_meshes,
                     tiny_config)


def loss_worker(rank, world):
    g = torch.Generator().manual_seed(0)
    B, S, H, V = 2, 12 * world, 16, 40
    h = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (B, S), generator=g)
    t[0, ::3] = -100
    t[:, S - 12:] = -100  # the last rank's targets are all ignored
    ref_inputs = [x.clone().requires_grad_() for x in (h, w, b)]
    ref = F.cross_entropy(F.linear(*ref_inputs).flatten(0, 1), t.flatten(), ignore_index=-100)
    ref.backward()

    mesh = cp_mesh()
    hl = local_slice(h, rank, world).clone().requires_grad_()
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    loss = cp_linear_cross_entropy(hl, wl, local_slice(t, rank, world), mesh, chunk_size=5, lm_head_bias=bl)
    loss.backward()
    d_hidden = [torch.empty_like(hl.grad) for _ in range(world)]
    dist.all_gather(d_hidden, hl.grad)
    for grad in (wl.grad, bl.grad):
        dist.all_reduce(grad)
    checks = {"value": abs(loss.item() - ref.item()) / ref.item(),
              "hidden grad": rel_l2(torch.cat(d_hidden, dim=1), ref_inputs[0].grad),
              "weight grad": rel_l2(wl.grad, ref_inputs[1].grad),
              "bias grad": rel_l2(bl.grad, ref_inputs[2].grad)}
    failures = [f"{k}: {v:.2e}" for k, v in checks.items() if not v <= 1e-12]
    assert not failures, f"rank {rank}: " + "; ".join(failures)


def model_worker(rank, world):
    torch.manual_seed(0)
    failures = []
    for tied in (False, True):
        base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config(tie_word_embeddings=tied)).double())
        B, S = 2, 64
        ids = torch.randint(0, 256, (B, S))
        # single device, full logits: the reference
        ref = parallelize_qwen3_5_cp(copy.deepcopy(base), self_meshes(), linear_attention_cp_mode="p2p")
        batch = shard_batch_for_cp(ids, self_meshes())
        inputs = {k: v for k, v in batch.items() if k != "target_ids"}
        loss_ref = cp_cross_entropy(ref(**inputs, use_cache=False).logits, batch["target_ids"], self_meshes())
        loss_ref.backward()
        grads_ref = grads_of(ref)
        mesh = cp_mesh()
        batch = shard_batch_for_cp(ids, mesh)
        inputs = {k: v for k, v in batch.items() if k != "target_ids"}
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        for fsdp in (False, True):
            model = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p")
            if fsdp:  # the head's weight exists unsharded only inside the root's forward: cp_causal_lm_loss
                fully_shard_qwen3_5(model, mesh)
                loss = cp_causal_lm_loss(model, batch["target_ids"], mesh, chunk_size=16, **inputs,
                                         use_cache=False)
            else:  # the text model's last hidden state and the head's weight
                hidden = model.model(**inputs, use_cache=False).last_hidden_state
                loss = cp_linear_cross_entropy(hidden, model.lm_head.weight, batch["target_ids"], mesh,
                                               chunk_size=16)
            loss.backward()
            if fsdp:
                grads = full_tensors({n: p.grad for n, p in model.named_parameters()})
            else:
                all_reduce_cp_grads(model, mesh)
                grads = grads_of(model)
            assert type(model.lm_head).forward is not None and "forward" not in model.lm_head.__dict__
            # float64 model; transformers' RMSNorm computes in float32 (as in test_model_parity)
            checks = {"loss": abs(loss.item() - loss_ref.item()) / loss_ref.item(),
                      "all grads": rel_l2(flat(grads), flat(grads_ref)),
                      "head grad": rel_l2(grads[head], grads_ref[head])}
            failures += [f"tied={tied} fsdp={fsdp} {k}: {v:.2e}" for k, v in checks.items() if not v < 1e-7]
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


LOGPROB_CASES = [  # (sequence_layout, packed, fsdp, activation checkpointing, tied, temperature)
    ("contiguous", False, False, False, False, 0.7),
    ("balanced", True, True, True, True, 1.3),
    ("balanced", False, False, True, False, 1.0),
    ("contiguous", True, True, False, False, 0.7),
]
PACKED = [0, 5, 16, 30, 31, 50, 64]  # documents crossing pieces and ranks (pieces of 8 at CP4 under balanced)


def _reference_logprobs(logits, targets, temperature):
    """Independent of deltacp's op: log_softmax of the full logits / T, gathered; -sum p log p at every token."""
    log_p = F.log_softmax(logits / temperature, dim=-1)
    logp = log_p.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1).masked_fill(targets == -100, 0)
    return logp, -(log_p.exp() * log_p).sum(-1)


def logprobs_worker(rank, world):
    torch.manual_seed(0)
    bases = {tied: long_memory_gates_(Qwen3_5ForCausalLM(tiny_config(tie_word_embeddings=tied)).double())
             for tied in (False, True)}
    S = 64
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, S), generator=g)
    w, u = torch.randn(2, S, generator=g, dtype=torch.float64), torch.randn(2, S, generator=g, dtype=torch.float64)
    mesh, single = cp_mesh(), self_meshes()
    failures = []
    for layout, packed, fsdp, ac, tied, temperature in LOGPROB_CASES:
        rows = slice(0, 1) if packed else slice(0, 2)
        cu = torch.tensor(PACKED) if packed else None
        # single device, full logits: the reference
        ref = parallelize_cp(copy.deepcopy(bases[tied]), single, linear_attention_cp_mode="p2p")
        batch = shard_batch_for_cp(ids[rows], single, cu_seqlens=cu)
        targets = batch.pop("target_ids")
        logp_ref, ent_ref = _reference_logprobs(ref(**batch, use_cache=False).logits, targets, temperature)
        (w[rows] * logp_ref + u[rows] * ent_ref).sum().backward()
        grads_ref = grads_of(ref)
        # CP
        model = parallelize_cp(copy.deepcopy(bases[tied]), mesh, linear_attention_cp_mode="p2p",
                               sequence_layout=layout)
        if ac:
            apply_activation_checkpointing(model)
        if fsdp:
            fully_shard_cp(model, mesh)
        batch = shard_batch_for_cp(ids[rows], mesh, cu_seqlens=cu, sequence_layout=layout)
        targets = batch.pop("target_ids")
        logp, ent = cp_token_logprobs(model, targets, mesh, temperature=temperature, return_entropy=True,
                                      chunk_size=5, **batch, use_cache=False)
        mine = lambda x: local_slice(x, rank, world, layout=layout)  # noqa: E731
        (mine(w[rows]) * logp + mine(u[rows]) * ent).sum().backward()
        if fsdp:
            grads = full_tensors({n: p.grad for n, p in model.named_parameters()})
        else:
            all_reduce_cp_grads(model, mesh)
            grads = grads_of(model)
        assert logp.dtype == ent.dtype == torch.float64 and "forward" not in model.lm_head.__dict__
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        case = f"{layout} {'packed' if packed else 'B=2'} fsdp={fsdp} ac={ac} tied={tied} T={temperature}"
        checks = {"logp": (rel_l2(logp, mine(logp_ref)), 1e-10), "entropy": (rel_l2(ent, mine(ent_ref)), 1e-10),
                  "all grads": (rel_l2(flat(grads), flat(grads_ref)), 1e-8),
                  "head grad": (rel_l2(grads[head], grads_ref[head]), 1e-8)}
        if rank == 0:
            print(case, {k: f"{v:.1e}" for k, (v, _) in checks.items()}, flush=True)
        failures += [f"{case} {k}: {v:.2e}" for k, (v, bound) in checks.items() if not v <= bound]
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def worker(rank, world):
    loss_worker(rank, world)
    model_worker(rank, world)
    logprobs_worker(rank, world)


def test_linear_cross_entropy_causal_lm_loss_and_token_logprobs_cp4():
    run_distributed(worker, 4, timeout_s=600)
