"""The output-head ops: the head's logits h W^T (+ b) reduced per token without ever holding [tokens, vocab]
(at 32K tokens and Qwen3.5's vocabulary of 248,320 they are 16 GB in bf16). No ranks here: the CP reductions
around them live in `deltacp.losses`.

    chunks.py         chunk budgets, the one chunk loop (logits chunk -> dlogits -> d hidden, d weight, d bias)
    kernels.py        the kernels over a chunk of logits: contract, PyTorch implementations, kernel selection
                      (Triton ones in ops/fused/linear_ce.py and ops/fused/token_logprobs.py, imported lazily)
    checks.py         argument checks shared with the model-facing callers
    cross_entropy.py  linear_cross_entropy_sum: the summed cross entropy, gradients computed in the forward
    logprobs.py       linear_token_logprobs: per-token log-probabilities (and entropy) under a temperature,
                      backward for any per-token upstream gradients (recomputing the logits)
    metrics.py        head_token_stats: entropy and top-1 accuracy at the valid targets, for logging (no gradient)
"""

from deltacp.ops.lm_head.chunks import WEIGHT_GRAD_MODES, chunk_sizes
from deltacp.ops.lm_head.cross_entropy import linear_cross_entropy_sum
from deltacp.ops.lm_head.kernels import IGNORE_INDEX
from deltacp.ops.lm_head.logprobs import linear_token_logprobs
from deltacp.ops.lm_head.metrics import head_token_stats

__all__ = ["IGNORE_INDEX", "WEIGHT_GRAD_MODES", "chunk_sizes", "head_token_stats", "linear_cross_entropy_sum",
           "linear_token_logprobs"]
