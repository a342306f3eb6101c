"""Operator experience: a dead peer is a one-line error on the surviving rank, not a hang."""

import pytest

from deltacp.distributed.launch import run_distributed
from deltacp.train.cli import describe_failure
from deltacp.train.config import ConfigError, load_config
from test_train_parity import MAIN

pytestmark = pytest.mark.fast


def _die_after_step_2(trainer, row):
    if trainer.rank == 1 and row["step"] == 2:
        import os

        os._exit(0)  # a peer vanishes (exit code 0 so that the harness waits for rank 0's verdict)


def dead_peer_worker(rank, world, cfg, results):
    from deltacp.train.trainer import Trainer, TrainHooks

    try:
        Trainer(cfg, progress=False, hooks=TrainHooks(on_step_end=_die_after_step_2)).fit()
    except Exception as exc:  # noqa: BLE001
        results[rank] = describe_failure(exc, rank, cfg)
        return
    results[rank] = "no error"


def test_dead_peer_gives_one_line_error():
    import torch.multiprocessing as mp

    cfg = load_config(MAIN, ["train.steps=5", "train.accelerator.cp=2", "train.logging.progress=none",
                             "train.distributed.timeout_s=30"])
    with mp.Manager() as manager:
        results = manager.dict()
        run_distributed(dead_peer_worker, 2, cfg, results, timeout_s=300, collective_timeout_s=30)
        line = results[0]
    assert "\n" not in line
    assert line.startswith("deltacp.train: rank 0 failed in a collective (a peer died, or no progress within "
                           "train.distributed.timeout_s=30.0 s)"), line


def test_describe_failure_kinds():
    assert describe_failure(ConfigError("train.x: bad"), 0, None) == "deltacp.train: config error: train.x: bad"
    line = describe_failure(RuntimeError("[gloo] Timed out waiting 120000ms for recv\nmore"), 3, None)
    assert line.startswith("deltacp.train: rank 3 failed in a collective") and "\n" not in line
    assert describe_failure(ValueError("shape"), 1, None) == "deltacp.train: rank 1 failed: ValueError: shape"


if __name__ == "__main__":
    pytest.main([__file__])
