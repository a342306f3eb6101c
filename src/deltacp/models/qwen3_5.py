"""The names of earlier versions, kept as aliases of the family-neutral ones (every supported family, not only
Qwen3.5): `parallelize_qwen3_5_cp` = `parallelize_cp` (models/parallelize.py), `fully_shard_qwen3_5` =
`fully_shard_cp` (models/fsdp.py); `shard_batch_for_cp` (batching.py), `cp_cross_entropy` and `IGNORE_INDEX`
(losses.py) live where they belong and are re-exported here for old imports.
"""

from deltacp.batching import pad_packed_row, shard_batch_for_cp
from deltacp.models.fsdp import all_reduce_cp_grads, fully_shard_cp
from deltacp.losses import IGNORE_INDEX, cp_cross_entropy
from deltacp.models.parallelize import parallelize_cp

parallelize_qwen3_5_cp = parallelize_cp
fully_shard_qwen3_5 = fully_shard_cp

__all__ = ["IGNORE_INDEX", "all_reduce_cp_grads", "cp_cross_entropy", "fully_shard_cp", "fully_shard_qwen3_5",
           "pad_packed_row", "parallelize_cp", "parallelize_qwen3_5_cp", "shard_batch_for_cp"]
