"""Full attention past the head count (KV all-gather, ring) and the 2-D layout (ulysses_degree u < cp) on gloo,
float64, against deltacp's single-device computation (same code on a one-rank mesh) at 1e-8.

One spawn per world size runs every check (spawning is the expensive part):
- CP8 layer checks: full attention all_gather / ring at u in {1, 2, 4} (u = 1: no Ulysses), unpacked (B = 2),
  packed documents and padding, small tiles (many tiles per document); GDN 2-D (p2p, all_gather) at u 2 and 4,
  unpacked and packed: output, input gradient, every parameter gradient summed over ranks;
- CP8 model checks: u in {1, 2, 4, 8} with all_gather / ring and p2p / all_gather, packed documents included:
  logits, loss, all gradients, grad norm;
- CP16: an 8-head model (8 attention heads, 8 value heads: Ulysses stops at CP8) trains 2 AdamW steps at
  cp = 16 (1-D all_gather, and 2-D u = 2 with ring; then sequence_layout='balanced' with the p2p scan, 1-D ring
  and 2-D u = 2 all_gather), losses, gradients and weights equal to one device.
"""

import copy
from functools import partial

import torch
import torch.distributed as dist
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
    Qwen3_5TextRotaryEmbedding,
)

from deltacp import LinearAttentionContextParallel, all_reduce_cp_grads, cp_cross_entropy, parallelize_qwen3_5_cp
from deltacp import shard_batch_for_cp
from deltacp.parallel.attention import attention_cp_plan, install_kv_cp_attention
from deltacp.parallel.documents import AttentionDocuments, CPForwardContext, cu_seqlens_from_padding
from deltacp.distributed.launch import run_distributed
from helpers import (computed_once, cp_mesh, flat, grads_of, local_slice, long_memory_gates_, rel_l2, self_meshes,
                     tiny_attention, tiny_config)

TIGHT = 1e-8
PACKED = [0, 3, 40, 41, 100, 160, 161, 230, 256]  # lengths 1 and 3, boundaries inside and on rank boundaries


def _record(failures, tag, figures, bound):
    failures += [f"{tag} {k}: {v:.2e}" for k, v in figures.items() if not v < bound]


def attention_checks(rank, world, failures):
    torch.manual_seed(2)
    config = tiny_config()  # 8 query heads, 2 KV heads, head dim 16
    base = tiny_attention(config)
    rotary = Qwen3_5TextRotaryEmbedding(config)
    S = 256
    mesh, single = cp_mesh(), self_meshes()
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, 200:] = 0  # right padding of row 1: crosses rank boundaries
    cases = {"unpacked": (2, None), "packed": (1, torch.tensor(PACKED)),
             "padding": (2, cu_seqlens_from_padding(mask))}
    inputs = {}
    for name, (B, cu) in cases.items():
        x = torch.randn(B, S, 64, dtype=torch.float64)
        d_out = torch.randn(B, S, 64, dtype=torch.float64)
        positions = torch.arange(S).expand(B, S)
        cos, sin = rotary(x, positions[None].expand(3, -1, -1))
        ctx = None if cu is None else CPForwardContext(attention=AttentionDocuments.build(cu))
        inputs[name] = x, d_out, cos, sin, ctx

    def reference(x, d_out, cos, sin, ctx):
        ref = install_kv_cp_attention(copy.deepcopy(base), attention_cp_plan(single, "all_gather", 1))
        xr = x.clone().requires_grad_()
        out_ref, _ = ref(xr, (cos, sin), ctx)
        (out_ref * d_out).sum().backward()
        return out_ref.detach(), xr.grad, flat(grads_of(ref))

    refs = computed_once(*(partial(reference, *inputs[name]) for name in cases))
    for (name, (x, d_out, cos, sin, ctx)), (out_ref, dx_ref, g_ref) in zip(inputs.items(), refs):
        for method in ("all_gather", "ring"):
            for u, block in ((1, None), (2, 16), (4, 7)):
                cp = install_kv_cp_attention(copy.deepcopy(base), attention_cp_plan(mesh, method, u, block=block))
                xl = local_slice(x, rank, world).clone().requires_grad_()
                out, _ = cp(xl, (local_slice(cos, rank, world), local_slice(sin, rank, world)), ctx)
                (out * local_slice(d_out, rank, world)).sum().backward()
                all_reduce_cp_grads(cp, mesh)
                valid = slice(None) if name != "padding" else local_slice(mask, rank, world).bool()
                _record(failures, f"attention {name} {method} u={u} block={block}", {
                    "output": rel_l2(out[valid], local_slice(out_ref, rank, world)[valid]),
                    "input grad": rel_l2(xl.grad, local_slice(dx_ref, rank, world)),
                    "param grads": rel_l2(flat(grads_of(cp)), g_ref)}, TIGHT)


def gdn_two_d_checks(rank, world, failures):
    torch.manual_seed(1)
    base = long_memory_gates_(Qwen3_5GatedDeltaNet(tiny_config(), 0).double())  # Hk 4, Hv 8
    S = 256
    x = torch.randn(1, S, 64, dtype=torch.float64)
    d_out = torch.randn(1, S, 64, dtype=torch.float64)
    mesh, single = cp_mesh(), self_meshes()
    runs = [(cu, mode) for cu in (None, torch.tensor(PACKED)) for mode in ("p2p", "all_gather")]

    def reference(cu, mode):
        ref = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(base), single)
        xr = x.clone().requires_grad_()
        out_ref = ref(xr, **({} if cu is None else {"cu_seq_lens_q": cu}))
        (out_ref * d_out).sum().backward()
        return out_ref.detach(), xr.grad, flat(grads_of(ref))

    refs = computed_once(*(partial(reference, cu, mode) for cu, mode in runs))
    for (cu, mode), (out_ref, dx_ref, g_ref) in zip(runs, refs):
        kw = {} if cu is None else {"cu_seq_lens_q": cu}
        for u in (2, 4):
            cp = LinearAttentionContextParallel(mode=mode, ulysses_degree=u).apply(copy.deepcopy(base), mesh)
            xl = local_slice(x, rank, world).clone().requires_grad_()
            out = cp(xl, **kw)
            (out * local_slice(d_out, rank, world)).sum().backward()
            all_reduce_cp_grads(cp, mesh)
            _record(failures, f"GDN 2-D {mode} u={u} {'packed' if cu is not None else 'unpacked'}", {
                "output": rel_l2(out, local_slice(out_ref, rank, world)),
                "input grad": rel_l2(xl.grad, local_slice(dx_ref, rank, world)),
                "param grads": rel_l2(flat(grads_of(cp)), g_ref)}, TIGHT)


def _model_step(model, mesh, ids, cu, layout="contiguous"):
    batch = shard_batch_for_cp(ids, mesh, cu_seqlens=cu, sequence_layout=layout)
    logits = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
    loss = cp_cross_entropy(logits, batch["target_ids"], mesh)
    loss.backward()
    return logits.detach(), loss.detach()


MODEL_LAYOUTS = [  # (ulysses_degree, linear_attention_cp_mode, full_attention_cp, packed)
    (1, "p2p", "all_gather", True), (1, "all_gather", "ring", False),
    (2, "p2p", "ring", True), (2, "all_gather", "all_gather", False),
    (4, "p2p", "all_gather", False), (4, "all_gather", "ring", True),
    (8, "p2p", "ring", True), (None, "ulysses", "all_gather", True),
]


def model_checks(rank, world, failures):
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config()).double())
    ids = torch.randint(0, 256, (1, 256))
    mesh, single = cp_mesh(), self_meshes()

    def reference(packed):
        ref = parallelize_qwen3_5_cp(copy.deepcopy(base), single, linear_attention_cp_mode="p2p")
        logits_ref, loss_ref = _model_step(ref, single, ids, torch.tensor(PACKED) if packed else None)
        return logits_ref, loss_ref, flat(grads_of(ref))

    refs = dict(zip((False, True), computed_once(partial(reference, False), partial(reference, True))))
    for u, mode, method, packed in MODEL_LAYOUTS:
        logits_ref, loss_ref, g_ref = refs[packed]
        cp = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, ulysses_degree=u, linear_attention_cp_mode=mode,
                                    full_attention_cp=method)
        logits, loss = _model_step(cp, mesh, ids, torch.tensor(PACKED) if packed else None)
        all_reduce_cp_grads(cp, mesh)
        g = flat(grads_of(cp))
        # 1e-7 as the other model parity tests: transformers' decoder RMSNorms compute in float32 on both sides
        _record(failures, f"model u={u} {mode}+{method} {'packed' if packed else 'unpacked'}", {
            "logits": rel_l2(logits, local_slice(logits_ref, rank, world)),
            "loss": abs(loss.item() / loss_ref.item() - 1), "all grads": rel_l2(g, g_ref),
            "grad norm": abs(g.norm().item() / g_ref.norm().item() - 1)}, 1e-7)


def cp8_worker(rank, world):
    failures = []
    attention_checks(rank, world, failures)
    gdn_two_d_checks(rank, world, failures)
    model_checks(rank, world, failures)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_attention_and_two_d_parity_cp8():
    run_distributed(cp8_worker, 8, timeout_s=1200)


def cp16_train_worker(rank, world):
    """An 8-head model (Ulysses stops at CP8) trains at cp = 16: 2 AdamW steps on new packed rows each step."""
    torch.manual_seed(0)
    config = tiny_config(hidden_size=32, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=8,
                         linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8)
    base = long_memory_gates_(Qwen3_5ForCausalLM(config).double())
    data = torch.Generator().manual_seed(1)
    S = 128  # 8 tokens per rank
    batches = [(torch.randint(0, 256, (1, S), generator=data),
                torch.tensor([0] + sorted(torch.randperm(S - 2, generator=data)[:4].add(1).tolist()) + [S]))
               for _ in range(2)]
    mesh, single = cp_mesh(), self_meshes()
    failures = []

    def train(model, m, layout="contiguous"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for ids, cu in batches:
            _, loss = _model_step(model, m, ids, cu, layout)
            if m.size() > 1:
                all_reduce_cp_grads(model, m)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, flat({n: p.detach() for n, p in model.named_parameters()})

    (losses_ref, weights_ref), = computed_once(
        lambda: train(parallelize_qwen3_5_cp(copy.deepcopy(base), single, linear_attention_cp_mode="p2p"), single))
    # the 2-D layout contiguous, then the balanced layout (pieces of 4 tokens, 32 of them) with the scan over the
    # pieces (1-D p2p chain + all_gather, the plainest, is CP8's and below: not rerun here for the suite's time)
    for u, mode, method, passing, layout in ((2, "p2p", "ring", "chain", "contiguous"),
                                             (None, "p2p", "ring", "scan", "balanced"),
                                             (2, "p2p", "all_gather", "scan", "balanced")):
        model = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, ulysses_degree=u, linear_attention_cp_mode=mode,
                                       full_attention_cp=method, linear_attention_state_passing=passing,
                                       sequence_layout=layout)
        losses, weights = train(model, mesh, layout)
        diff = max(abs(a / b - 1) for a, b in zip(losses, losses_ref))
        _record(failures, f"CP16 {layout} u={u} {mode}/{passing}+{method} 2 steps", {
            "max loss rel diff": diff, "weights after": rel_l2(weights, weights_ref)}, 1e-7)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_eight_head_model_trains_at_cp16():
    run_distributed(cp16_train_worker, 16, timeout_s=900)
