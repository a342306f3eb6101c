"""deltacp under the trainers users already run: transformers' `Trainer`, TRL's `SFTTrainer` and `GRPOTrainer` at
dp x cp.

    from deltacp.integrations import CPSFTTrainer            # or CPTrainer (transformers' Trainer)
    trainer = CPSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tok, cp_size=4)
    trainer.train()                                          # torchrun --nproc-per-node 8: dp 2 x cp 4

    from deltacp.integrations import CPGRPOTrainer           # TRL's GRPOTrainer: RL on long rollouts
    trainer = CPGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds, cp_size=4)

`CPTrainerMixin` goes first in the bases of another subclass of Trainer / SFTTrainer (`class T(CPTrainerMixin,
SFTTrainer)`), `CPGRPOMixin` before a GRPOTrainer subclass; `shard_collated_batch` cuts a collator's batch for a loop
of your own. Needs the `integrations` extra (accelerate; trl for CPSFTTrainer and CPGRPOTrainer). See
`deltacp.integrations.trainer` and `deltacp.integrations.grpo` for what is supported and refused.
"""

from deltacp.integrations.batch import CPBatch, shard_collated_batch
from deltacp.integrations.trainer import (CPTrainerBase, CPTrainerMixin, checkpointing_arguments,
                                          mark_prepared_for_accelerate)

__all__ = ["CPBatch", "CPGRPOMixin", "CPGRPOTrainer", "CPSFTTrainer", "CPTrainer", "CPTrainerBase", "CPTrainerMixin",
           "checkpointing_arguments", "mark_prepared_for_accelerate", "shard_collated_batch"]


def __getattr__(name: str):
    """CPTrainer / CPSFTTrainer / CPGRPOTrainer (and CPGRPOMixin), built on first use (they import transformers'
    Trainer / TRL)."""
    if name == "CPTrainer":
        from transformers import Trainer

        cls = type("CPTrainer", (CPTrainerMixin, Trainer), {
            "__doc__": "transformers' Trainer under dp x cp (deltacp.integrations.CPTrainerMixin); keyword cp_size.",
            "__module__": __name__})
    elif name == "CPSFTTrainer":
        from trl import SFTTrainer

        cls = type("CPSFTTrainer", (CPTrainerMixin, SFTTrainer), {
            "__doc__": "TRL's SFTTrainer under dp x cp (deltacp.integrations.CPTrainerMixin); keyword cp_size.",
            "__module__": __name__})
    elif name == "CPGRPOMixin":
        from deltacp.integrations.grpo import CPGRPOMixin as cls
    elif name == "CPGRPOTrainer":
        from trl import GRPOTrainer

        from deltacp.integrations.grpo import CPGRPOMixin

        cls = type("CPGRPOTrainer", (CPGRPOMixin, GRPOTrainer), {
            "__doc__": "TRL's GRPOTrainer under dp x cp (deltacp.integrations.grpo.CPGRPOMixin); keyword cp_size.",
            "__module__": __name__})
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls
    return cls
