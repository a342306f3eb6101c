"""Activation memory of a GDN hybrid's decoder layers under each activation checkpointing policy, analytic from the
text config, and the `auto` plan: how many decoder layers to checkpoint, and under which policy, for a budget.

    shape = LayerShapes.of(model.config.get_text_config())
    plan = plan_activation_checkpointing(shape, tokens=16384, row_tokens=65536, activation_bytes=2,
                                         static_bytes=..., budget_bytes=..., backend="triton",
                                         full_attention_cp="ulysses")
    apply_activation_checkpointing(model, policy=plan.policy, num_layers=plan.num_layers)   # if plan.policy

Bytes one decoder layer keeps for its backward, per rank (T tokens on the rank, e the activation element size: bf16
2; f = max(e, 4) for what is kept in fp32 or wider), as the CPU test measures them on deltacp's forwards
(tests/unit/test_memory_plan.py: within 3% on the Triton path, 10% on the eager path):

  every layer, the fused decoder (Triton backend)  4 D e (norm in/out, residual, MLP input) + the MLP
      eager backend (transformers' RMSNorm)        + 3 D f
  dense MLP (SwiGLU)                               4 I e;   routed experts: k (4 I_moe e + 2 D e) + 4 I_shared e
                                                   + E f (k of E experts per token)
  GDN, Triton backend                              C e (pre-conv q|k|v, C = 2 Hk Dk + Hv Dv) + 4 Hk Dk e (q, k before
                                                   and after their l2 norm) + 4 Hv Dv e (v, z, o, the out projection's
                                                   input) + 64 Hv f (the chunk inverse T) + 5 Hv f (gates)
  GDN, eager backend                               2 C e + 4 Hk Dk f + 3 Hv Dv e + 18 Hv Dv f (fp32 chunk tensors)
                                                   + 5 x 64 Hv f (chunk matrices) + 5 Hv f
  full attention                                   2 (Hq + Hkv) Dh f (the q/k norms in fp32) + (4 Hq + 2 Hkv) Dh e
                                                   (q, k, v, o, the gate, the out projection's input) + Hq f (lse);
                                                   under full_attention_cp='all_gather' k and v are the gathered
                                                   rows' (gathered_tokens instead of T: every row of the rank's batch)

Under policy "full" a checkpointed layer keeps its input (D e); "selective" adds, on attention layers, the attention
output and its log-sum-exp (Hq Dh e + Hq f). A layer that is not checkpointed keeps all of the above ("none"); the
recompute of a checkpointed layer holds the same ("recompute"). Estimated peak = static (parameters, gradients, optimizer states,
unsharded compute copies: `static_bytes`) + what every layer keeps + the larger of the end of the forward (4 T D e:
final norm, loss input gradient, a logits chunk about T x D) and the backward of a checkpointed layer (the largest
checkpointed layer's recompute and the gradient flow, 2 T D e). On the 2B shape at cp = 1 (bench/step.py, full)
this was 17.4 / 27.5 GiB at 16K / 64K tokens against 16.2 / 25.9 measured (NOTES.md): about 7% high, on the safe
side.

The plan keeps the last decoder layers un-checkpointed (their activations are the first freed in backward) and
checkpoints the first n under one policy; among every (policy, n) that fits the budget it takes the one with the
least recompute (FLOPs of the checkpointed layers' recompute: matmuls and the attention core, which "selective" does
not recompute), then the least memory. When nothing fits, every layer under "full" (fits=False: the caller warns).
"""

from __future__ import annotations

from dataclasses import dataclass

from deltacp.models.checkpointing import POLICIES

CHUNK = 64  # the GDN chunk (ops/gdn/contract.py CHUNK_SIZE): the Triton backend keeps T = (I + A)^-1 per chunk row
GIB = 2 ** 30


@dataclass(frozen=True)
class LayerShapes:
    """What the estimate reads of a text config."""

    layer_types: tuple[str, ...]
    hidden: int
    intermediate: int  # dense MLP width (0 for routed experts)
    heads: int
    kv_heads: int
    head_dim: int
    gdn_qk_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0

    @classmethod
    def of(cls, config) -> "LayerShapes":
        """From a transformers text config (Qwen3.5 dense / MoE, Qwen3-Next)."""
        experts = int(getattr(config, "num_experts", 0) or 0)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(layer_types=tuple(config.layer_types[: config.num_hidden_layers]), hidden=config.hidden_size,
                   intermediate=0 if experts else config.intermediate_size, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   gdn_qk_heads=config.linear_num_key_heads, gdn_v_heads=config.linear_num_value_heads,
                   gdn_k_dim=config.linear_key_head_dim, gdn_v_dim=config.linear_value_head_dim, experts=experts,
                   experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
                   expert_intermediate=int(getattr(config, "moe_intermediate_size", 0) or 0) if experts else 0,
                   shared_intermediate=int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
                   if experts else 0)


def layer_bytes(shape: LayerShapes, kind: str, tokens: int, e: int, *, row_tokens: int | None = None,
                gathered_tokens: int | None = None, backend: str = "triton",
                full_attention_cp: str = "ulysses") -> dict[str | None, int]:
    """{None: not checkpointed, "recompute": its recompute when checkpointed, "full": ..., "selective": ...} bytes the
    layer keeps for backward on one rank of `tokens` tokens (module doc). gathered_tokens: the tokens of every row
    the rank holds a piece of (the K/V that all_gather keeps; default row_tokens, the tokens of one row, then
    `tokens`)."""
    f = max(e, 4)
    T, D = tokens, shape.hidden
    common = 4 * D * e + (3 * D * f if backend == "eager" else 0)
    if shape.experts:
        k = shape.experts_per_token
        mlp = k * (4 * shape.expert_intermediate * e + 2 * D * e) + 4 * shape.shared_intermediate * e \
            + shape.experts * f
    else:
        mlp = 4 * shape.intermediate * e
    Hv, qk = shape.gdn_v_heads, shape.gdn_qk_heads * shape.gdn_k_dim
    vd = Hv * shape.gdn_v_dim
    conv = 2 * qk + vd
    if kind == "linear_attention":
        if backend == "eager":
            mixer = 2 * conv * e + 4 * qk * f + 3 * vd * e + 18 * vd * f + 5 * CHUNK * Hv * f + 5 * Hv * f
        else:
            mixer = conv * e + 4 * qk * e + 4 * vd * e + CHUNK * Hv * f + 5 * Hv * f
        kept_output = 0
        per_row = 0
    elif kind == "full_attention":
        Hq, Hkv, Dh = shape.heads, shape.kv_heads, shape.head_dim
        mixer = 2 * (Hq + Hkv) * Dh * f + 4 * Hq * Dh * e + Hq * f
        kv = 2 * Hkv * Dh * e
        per_row = kv if full_attention_cp == "all_gather" else 0
        mixer += 0 if per_row else kv
        kept_output = Hq * Dh * e + Hq * f
    else:
        raise ValueError(f"layer type {kind!r}: expected 'linear_attention' or 'full_attention'")
    gathered = next(n for n in (gathered_tokens, row_tokens, tokens) if n is not None)
    none = T * (common + mlp + mixer) + gathered * per_row
    return {None: none, "recompute": none, "full": T * D * e,
            "selective": T * (D * e + kept_output)}


def layer_forward_flops(shape: LayerShapes, kind: str, tokens: int, row_tokens: int | None = None
                        ) -> tuple[float, float]:
    """(FLOPs of the recompute of one checkpointed decoder layer on `tokens` tokens, of which the attention core's),
    for ranking plans: matmuls 2 x tokens x weights, a dense MLP's gate and up projections only (torch's early stop
    ends the recompute before its down projection: `ops/recompute.py`); causal attention 2 Hq Dh x tokens x mean context (row_tokens /
    2 on average: the rank's tokens see half the row), the GDN core 4 x tokens x Hv Dk Dv (chunked, small)."""
    T, D = tokens, shape.hidden
    row = row_tokens if row_tokens is not None else tokens
    if shape.experts:
        mlp = 2 * T * D * 3 * (shape.experts_per_token * shape.expert_intermediate + shape.shared_intermediate)
    else:
        mlp = 2 * T * D * 2 * shape.intermediate
    if kind == "linear_attention":
        qk, vd = shape.gdn_qk_heads * shape.gdn_k_dim, shape.gdn_v_heads * shape.gdn_v_dim
        proj = 2 * T * D * (2 * qk + 2 * vd + 2 * shape.gdn_v_heads) + 2 * T * vd * D
        core = 4 * T * shape.gdn_v_heads * shape.gdn_k_dim * shape.gdn_v_dim
        return float(mlp + proj + core), 0.0
    Hq, Hkv, Dh = shape.heads, shape.kv_heads, shape.head_dim
    proj = 2 * T * D * (2 * Hq * Dh + 2 * Hkv * Dh) + 2 * T * Hq * Dh * D
    core = 4 * Hq * Dh * T * (row / 2)
    return float(mlp + proj + core), float(core)


def static_bytes(param_counts: tuple[int, ...], other_params: int, *, param_bytes: int, compute_bytes: int,
                 world: int, fsdp: bool) -> int:
    """Parameters, gradients and AdamW's two states (4 copies in the parameters' dtype), sharded over `world` ranks
    under FSDP2; with FSDP2, the unsharded compute copies of the root's parameters (embeddings, head, final norm)
    and of two decoder layers (one prefetched). param_counts: per decoder layer; other_params: the rest."""
    total = sum(param_counts) + other_params
    held = 4 * param_bytes * (-(-total // world) if fsdp else total)
    if fsdp:
        held += compute_bytes * (other_params + 2 * max(param_counts, default=0))
    return held


@dataclass(frozen=True)
class CheckpointPlan:
    """The `auto` choice: checkpoint the first `num_layers` of `total_layers` decoder layers under `policy` (None:
    none), with its estimated peak (bytes) against the budget."""

    policy: str | None
    num_layers: int
    total_layers: int
    peak_bytes: int
    budget_bytes: int
    static_bytes: int
    recompute_flops: float
    fits: bool

    def describe(self) -> str:
        what = "no checkpointing" if self.policy is None else (
            f"{self.policy} on the first {self.num_layers} of {self.total_layers} decoder layers")
        note = "" if self.fits else " (NOTHING FITS: every layer under full; the step may run out of memory)"
        return (f"activation checkpointing auto: {what}; estimated peak {self.peak_bytes / GIB:.2f} GiB (static "
                f"{self.static_bytes / GIB:.2f}) of a budget of {self.budget_bytes / GIB:.2f} GiB, recompute "
                f"{self.recompute_flops / 1e12:.2f} TFLOP per step{note}")


def plan_activation_checkpointing(shape: LayerShapes, *, tokens: int, activation_bytes: int, static_bytes: int,
                                  budget_bytes: int, row_tokens: int | None = None,
                                  gathered_tokens: int | None = None, backend: str = "triton",
                                  full_attention_cp: str = "ulysses") -> CheckpointPlan:
    """The plan of the module doc for one rank holding `tokens` tokens (row_tokens: one whole row's, for the attention
    context; gathered_tokens: every row's the rank holds a piece of, for all_gather's K/V; see `layer_bytes`)."""
    e = activation_bytes
    kinds = shape.layer_types
    L = len(kinds)
    kept = [layer_bytes(shape, k, tokens, e, row_tokens=row_tokens, gathered_tokens=gathered_tokens,
                        backend=backend, full_attention_cp=full_attention_cp) for k in kinds]
    flops = [layer_forward_flops(shape, k, tokens, row_tokens) for k in kinds]
    TDe = tokens * shape.hidden * e

    def peak(policy, n):
        held = static_bytes + sum(kept[i][policy] if i < n else kept[i][None] for i in range(L))
        recompute = max((kept[i]["recompute"] for i in range(n)), default=0)
        return held + max(4 * TDe, recompute + 2 * TDe)

    best = None
    for policy, n in [(None, 0)] + [(policy, n) for policy in POLICIES for n in range(1, L + 1)]:
        cost = sum(total - (core if policy == "selective" else 0.0) for total, core in flops[:n])
        plan = CheckpointPlan(policy, n, L, peak(policy, n), budget_bytes, static_bytes, cost,
                              peak(policy, n) <= budget_bytes)
        if plan.fits and (best is None or (cost, plan.peak_bytes) < (best.recompute_flops, best.peak_bytes)):
            best = plan
    if best is None:
        best = CheckpointPlan("full", L, L, peak("full", L), budget_bytes, static_bytes, sum(t for t, _ in flops),
                              False)
    return best
