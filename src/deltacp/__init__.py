"""deltacp: context parallelism for Gated DeltaNet hybrid models (the Qwen3.5 family and Qwen3-Next).

Importing deltacp never imports Triton; `linear_attention_gdn_backend="triton"` does, lazily.
"""

from deltacp.models.qwen3_5 import (
    all_reduce_cp_grads,
    cp_cross_entropy,
    fully_shard_qwen3_5,
    parallelize_cp,
    parallelize_qwen3_5_cp,
    shard_batch_for_cp,
)
from deltacp.models.adapters import supported_classes
from deltacp.models.loss import cp_causal_lm_loss, cp_linear_cross_entropy
from deltacp.models.moe import cp_load_balancing_loss
from deltacp.parallel.style import LinearAttentionContextParallel

__all__ = [
    "LinearAttentionContextParallel",
    "all_reduce_cp_grads",
    "cp_causal_lm_loss",
    "cp_cross_entropy",
    "cp_linear_cross_entropy",
    "cp_load_balancing_loss",
    "fully_shard_qwen3_5",
    "parallelize_cp",
    "parallelize_qwen3_5_cp",
    "shard_batch_for_cp",
    "supported_classes",
]
