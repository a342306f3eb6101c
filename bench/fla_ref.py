"""flash-linear-attention as a timing reference, when it is installed (it is not a dependency of deltacp).

FLA 0.6.0 refuses its gated dq/dk/dw/dg backward on Hopper with Triton >= 3.4, < 3.7.1 (a Triton miscompile,
its issue #640). `bypass_hopper_guard=True` lifts that refusal so its speed can be measured; its results on
that stack are then suspect, which is why every table that uses it says so and also prints FLA's rel-L2.
"""

from __future__ import annotations


def load_fla(bypass_hopper_guard: bool = False):
    """-> (label, fn(q, k, v, g, beta, h0) -> (o, ht)) or None when FLA is not importable."""
    try:
        import fla
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    label = f"fla-{getattr(fla, '__version__', '?')}"
    if bypass_hopper_guard and hasattr(fla_chunk_o, "TRITON_ABOVE_3_7_1") and not fla_chunk_o.TRITON_ABOVE_3_7_1:
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        label += " (Hopper guard bypassed)"

    def run(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)

    return label, run


def load_fla_varlen(bypass_hopper_guard: bool = False):
    """-> (label, fn(q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu) -> (o, final states [N, Hv, K, V])) or None.

    FLA's varlen form: one packed row, `cu_seqlens` int64 on the device (and on the host, to spare it a sync);
    `h0` [N, Hv, K, V] is the entering state of every document (deltacp's `first_continues` = h0 for document 0,
    zeros for the others)."""
    base = load_fla(bypass_hopper_guard)
    if base is None:
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def run(q, k, v, g, beta, h0, cu_seqlens, cu_seqlens_cpu=None):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                      cu_seqlens_cpu=cu_seqlens_cpu)

    return base[0], run
