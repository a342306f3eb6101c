"""dp x cp meshes (gloo CPU ranks, float32) against one device training on the same global batch.

- dp2 x cp2 (4 ranks), packed rows (configs/tiny_cp4.yaml, one packed row per dp group) for STEPS steps and
  unpacked rows (one row per dp group) for SHORT steps: loss and grad norm vs one device;
- resume anywhere: a checkpoint saved at dp1 x cp4 resumes at dp2 x cp2 (same spawn) and at dp1 x cp2
  (2 ranks) with the losses of uninterrupted runs at the new shapes (which themselves match one device);
- dp2 x cp4 (8 ranks) through the parity tool (`--spawn 8 --cp 4`), its CSV rows labelled dp2xcp4-p2p.

Bounds (float32; observed ~1e-7): loss rel diff <= LOSS_REL, grad-norm rel diff <= GNORM_REL per step. A
dropped dp scaling (loss mean per dp group) doubles the gradient; dp groups reading the same rows, or a data
position that is not global, change the loss at the first step or the first resumed step: far outside them.
"""

import csv
import shutil
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from deltacp.distributed.launch import run_distributed
from deltacp.train.config import CheckpointConfig, load_config
from deltacp.train.parity import compare, reference_config, run_jobs
from test_train_parity import MAIN

STEPS, SHORT, SAVE_AT = 12, 4, 6
LOSS_REL, GNORM_REL = 1e-5, 1e-4
SMALL = ["train.logging.progress=none", "train.data.seq_len=128", "train.data.batch_size=2",
         "train.schedule.warmup_steps=2", f"train.steps={STEPS}"]


def _cfg(*overrides):
    return load_config(MAIN, SMALL + list(overrides))


def _unpacked():
    return _cfg("train.data.packing=false")


def _check(reference, rows, label, n):
    assert [r["step"] for r in rows] == list(range(1, n + 1)), label
    comp = compare(reference[:n], rows)
    assert comp["finite"], f"{label}: NaN/Inf"
    assert comp["max_loss_rel"] <= LOSS_REL, f"{label}: max loss rel diff {comp['max_loss_rel']:.2e}"
    assert comp["max_grad_norm_rel"] <= GNORM_REL, f"{label}: max grad-norm rel diff {comp['max_grad_norm_rel']:.2e}"
    print(f"{label}: {n} steps, max loss rel {comp['max_loss_rel']:.2e}, "
          f"max grad-norm rel {comp['max_grad_norm_rel']:.2e}")


def _check_resumed(full, resumed, label):
    assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1)), label
    for ref, row in zip(full[SAVE_AT:], resumed, strict=True):  # same global batches; layout rounding only
        assert abs(row["loss"] - ref["loss"]) <= LOSS_REL * abs(ref["loss"]), (label, ref, row)
        assert abs(row["grad_norm"] - ref["grad_norm"]) <= GNORM_REL * abs(ref["grad_norm"]), (label, ref, row)
        assert row["lr"] == ref["lr"], label


def _quiet(cfg):
    return replace(cfg, checkpoint=CheckpointConfig())


def four_rank_worker(rank, world, ckpt_a, ckpt_b, results):
    from deltacp.train.trainer import Trainer, with_cp

    ck = ["train.checkpoint.interval=" + str(SAVE_AT)]
    out = {}
    trainer = Trainer(with_cp(_quiet(_cfg()), 2, dp=2), progress=False)
    assert (trainer.dp, trainer.cp, tuple(trainer.mesh.mesh_dim_names)) == (2, 2, ("dp", "cp"))
    # the parameter count it reports is the whole model's: the FSDP2 shards of the 4 ranks together
    held = torch.tensor(sum(p.to_local().numel() for p in trainer.model.parameters()))
    dist.all_reduce(held)
    assert trainer.n_params == held.item() and f"({held.item() / 1e6:.2f} M params" in trainer.describe(), \
        (trainer.n_params, held.item())
    out["dp2xcp2"] = trainer.fit()
    out["dp2xcp2-unpacked"] = Trainer(with_cp(_quiet(_unpacked()), 2, dp=2), progress=False).fit(SHORT)
    Trainer(with_cp(_cfg(f"train.checkpoint.dir={ckpt_a}", *ck), 4), progress=False).fit(SAVE_AT)  # dp1 x cp4
    if rank == 0:
        shutil.copytree(ckpt_a, ckpt_b)
    dist.barrier()
    out["dp2xcp2-resumed"] = Trainer(with_cp(_cfg(f"train.checkpoint.dir={ckpt_a}", *ck), 2), progress=False).fit()
    if rank == 0:
        results.update(out)


def two_rank_worker(rank, world, ckpt_b, results):
    from deltacp.train.trainer import Trainer, with_cp

    full = Trainer(with_cp(_quiet(_cfg()), 2), progress=False).fit()
    resumed = Trainer(with_cp(_cfg(f"train.checkpoint.dir={ckpt_b}"), 2), progress=False).fit()
    if rank == 0:
        results.update({"dp1xcp2": full, "dp1xcp2-resumed": resumed})


def test_dp2_cp2_and_cp2_parity_and_resume_from_dp1_cp4(tmp_path):
    import torch.multiprocessing as mp

    refs = run_jobs(1, [("packed", reference_config(_cfg(), STEPS)),
                        ("unpacked", reference_config(_unpacked(), SHORT))])
    ckpt_a, ckpt_b = tmp_path / "a", tmp_path / "b"
    with mp.Manager() as manager:
        results = manager.dict()
        run_distributed(four_rank_worker, 4, str(ckpt_a), str(ckpt_b), results, timeout_s=600)
        run_distributed(two_rank_worker, 2, str(ckpt_b), results, timeout_s=600)
        runs = dict(results)
    _check(refs["packed"], runs["dp2xcp2"], "dp2xcp2 packed", STEPS)
    _check(refs["unpacked"], runs["dp2xcp2-unpacked"], "dp2xcp2 unpacked", SHORT)
    _check(refs["packed"], runs["dp1xcp2"], "dp1xcp2 packed", STEPS)
    _check_resumed(runs["dp2xcp2"], runs["dp2xcp2-resumed"], "dp1xcp4 -> dp2xcp2")
    _check_resumed(runs["dp1xcp2"], runs["dp1xcp2-resumed"], "dp1xcp4 -> dp1xcp2")


def test_dp2_cp4_through_the_parity_tool(tmp_path, capsys):
    from deltacp.train.parity import main

    main(["--config", str(MAIN), "--spawn", "8", "--cp", "4", "--steps", str(SHORT), "--out", str(tmp_path),
          "--set", "train.data.seq_len=128", "--set", "train.schedule.warmup_steps=2"])
    assert "dp2xcp4-p2p" in capsys.readouterr().out
    with open(tmp_path / "parity.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["dp2xcp4-p2p"] * SHORT
    assert [int(r["step"]) for r in rows] == list(range(1, SHORT + 1))
    assert max(float(r["loss_rel"]) for r in rows) <= LOSS_REL, rows
    assert max(float(r["grad_norm_rel"]) for r in rows) <= GNORM_REL, rows
    print(f"dp2xcp4-p2p: {SHORT} steps, max loss rel {max(float(r['loss_rel']) for r in rows):.2e}, max grad-norm "
          f"rel {max(float(r['grad_norm_rel']) for r in rows):.2e}")


@pytest.mark.fast
def test_dp_groups_split_the_global_batch_in_order():
    import torch

    from deltacp.train.data import TokenStream

    for packing in (True, False):
        cfg = _cfg("train.data.seq_len=64", "train.data.batch_size=4", f"train.data.packing={str(packing).lower()}")
        whole = TokenStream(cfg.data, 0)
        groups = [TokenStream(cfg.data, 0) for _ in range(2)]
        for _ in range(3):
            ids, cu = whole.next_step(0, 1)
            parts = [g.next_step(i, 2) for i, g in enumerate(groups)]
            assert torch.equal(torch.cat([p[0] for p in parts], dim=1 if packing else 0), ids)
            if packing:  # each group's two rows joined; the whole batch: four rows joined
                assert ids.shape == (1, 256) and parts[0][0].shape == (1, 128)
                assert torch.equal(torch.cat([parts[0][1], parts[1][1][1:] + 128]), cu)
            else:
                assert cu is None and ids.shape == (4, 64)
        assert all(g.state_dict() == whole.state_dict() for g in groups)  # one global stream position
