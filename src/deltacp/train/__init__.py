"""The deltacp training job: `python -m deltacp.train --config configs/tiny_cp4.yaml --spawn 4` (or torchrun).

Files: config.py (the YAML as dataclasses), data.py (real text, no network), trainer.py (build, step, fit),
checkpoint.py (atomic, checksummed DCP checkpoints owned by one run, resumable at another cp), progress.py
(rank 0's progress line), parity.py (CP vs single device), plot.py (the parity PNG), cli.py (launch, spawn,
signals and one-line failures). The names below load on first use (the CLI checks a config before the trainer's
heavy imports).
"""

from __future__ import annotations

import importlib

_PUBLIC = {"ConfigError": "deltacp.train.config", "TrainConfig": "deltacp.train.config",
           "load_config": "deltacp.train.config", "Trainer": "deltacp.train.trainer",
           "TrainHooks": "deltacp.train.trainer"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'deltacp.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
