"""deltacp: context parallelism for Gated DeltaNet hybrid models (the Qwen3.5 family and Qwen3-Next).

Importing deltacp never imports Triton; `linear_attention_gdn_backend="triton"` does, lazily.
"""

from deltacp.distributed.launch import run_distributed
from deltacp.distributed.mesh import init_cp_mesh
from deltacp.models.adapters import supported_classes
from deltacp.models.batch import gather_cp_rows, shard_batch_for_cp
from deltacp.models.checkpointing import apply_activation_checkpointing
from deltacp.models.fsdp import all_reduce_cp_grads, fully_shard_cp, unsharded_parameters
from deltacp.models.loss import (
    IGNORE_INDEX,
    cp_causal_lm_loss,
    cp_cross_entropy,
    cp_linear_cross_entropy,
    cp_token_logprobs,
    linear_token_logprobs,
)
from deltacp.models.moe import cp_load_balancing_loss
from deltacp.models.parallelize import parallelize_cp, sequence_layout_of, suspend_cp
from deltacp.models.qwen3_5 import fully_shard_qwen3_5, parallelize_qwen3_5_cp
from deltacp.parallel.placement import SEQUENCE_LAYOUTS
from deltacp.parallel.style import FullAttentionContextParallel, LinearAttentionContextParallel, cp_layer_of

__all__ = [
    "FullAttentionContextParallel",
    "IGNORE_INDEX",
    "LinearAttentionContextParallel",
    "SEQUENCE_LAYOUTS",
    "all_reduce_cp_grads",
    "apply_activation_checkpointing",
    "cp_causal_lm_loss",
    "cp_cross_entropy",
    "cp_layer_of",
    "cp_linear_cross_entropy",
    "cp_load_balancing_loss",
    "cp_token_logprobs",
    "fully_shard_cp",
    "fully_shard_qwen3_5",
    "gather_cp_rows",
    "init_cp_mesh",
    "linear_token_logprobs",
    "parallelize_cp",
    "parallelize_qwen3_5_cp",
    "run_distributed",
    "sequence_layout_of",
    "shard_batch_for_cp",
    "supported_classes",
    "suspend_cp",
    "unsharded_parameters",
]
