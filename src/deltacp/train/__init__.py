"""The deltacp training job: `python -m deltacp.train --config configs/tiny_cp4.yaml --spawn 4` (or torchrun).

Files: config.py (the YAML as dataclasses), data.py (real text, no network), trainer.py (build, step, fit),
checkpoint.py (atomic, checksummed DCP checkpoints owned by one run, resumable at another cp), progress.py
(rank 0's progress line), parity.py (CP vs single device), plot.py (the parity PNG), cli.py (launch, spawn,
signals and one-line failures).
"""

from deltacp.train.config import ConfigError, TrainConfig, load_config
from deltacp.train.trainer import Trainer, TrainHooks

__all__ = ["ConfigError", "TrainConfig", "TrainHooks", "Trainer", "load_config"]
