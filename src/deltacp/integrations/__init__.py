"""deltacp under the trainers users already run: transformers' `Trainer` and TRL's `SFTTrainer` at dp x cp.

    from deltacp.integrations import CPSFTTrainer            # or CPTrainer (transformers' Trainer)
    trainer = CPSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tok, cp_size=4)
    trainer.train()                                          # torchrun --nproc-per-node 8: dp 2 x cp 4

`CPTrainerMixin` goes first in the bases of another subclass of those two (`class T(CPTrainerMixin, SFTTrainer)`);
`shard_collated_batch` cuts a collator's batch for a loop of your own. Needs the `integrations` extra
(accelerate; trl for CPSFTTrainer). See `deltacp.integrations.trainer` for what is supported and refused.
"""

from deltacp.integrations.batch import CPBatch, shard_collated_batch
from deltacp.integrations.trainer import CPTrainerMixin, mark_prepared_for_accelerate

__all__ = ["CPBatch", "CPSFTTrainer", "CPTrainer", "CPTrainerMixin", "mark_prepared_for_accelerate",
           "shard_collated_batch"]


def __getattr__(name: str):
    """CPTrainer / CPSFTTrainer, built on first use (they import transformers' Trainer / TRL)."""
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
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls
    return cls
