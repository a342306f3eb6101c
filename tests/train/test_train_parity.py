"""The training job on gloo CPU ranks against the single device (same trainer, world size 1), float32.

- the README main config (configs/tiny_cp4.yaml) at CP4, every mode, 10 steps (5 warm-up steps, the config's 10
  halved, and 5 of the cosine decay after):
  max loss rel diff < 1e-4, max grad-norm rel diff < 1e-3, all finite; in the same spawn, full activation
  checkpointing reproduces the first steps bit for bit, and the p2p layers' message logs are identical (no extra
  receive); with p2p, so do selective checkpointing and auto (a budget for which it checkpoints some layers,
  applied as planned);
- CP2 and CP8, every mode, the first 5 steps of the same schedule, same bounds;
- CP4 with train.accelerator.full_attention_cp = all_gather (1-D) and ring with ulysses_degree 2 (2-D), and ring
  with sequence_layout = balanced (p2p with the scan), the first 5 steps, same bounds, the attention layers
  running the configured method;
- kill while saving a checkpoint, then resume: the same losses as an uninterrupted run.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from deltacp.distributed.launch import run_distributed
from deltacp.train.checkpoint import complete_checkpoints
from deltacp.train.config import CheckpointConfig, load_config
from deltacp.train.parity import MODES, compare, cp_configs, reference_config, run_jobs

MAIN = Path(__file__).resolve().parents[2] / "configs" / "tiny_cp4.yaml"
STEPS, SHORT, AC_STEPS, WARMUP = 10, 5, 3, 5
LOSS_REL, GNORM_REL = 1e-4, 1e-3


def _main_cfg():
    # the main config's schedule with half its warm-up, so that the STEPS steps hold warm-up steps and cosine ones
    return load_config(MAIN, [f"train.steps={STEPS}", f"train.schedule.warmup_steps={WARMUP}",
                              "train.logging.progress=none"])


def _check(reference, rows, label):
    comp = compare(reference[: len(rows)], rows)
    assert comp["finite"], f"{label}: NaN/Inf"
    assert comp["max_loss_rel"] < LOSS_REL, f"{label}: max loss rel diff {comp['max_loss_rel']:.2e}"
    assert comp["max_grad_norm_rel"] < GNORM_REL, f"{label}: max grad-norm rel diff {comp['max_grad_norm_rel']:.2e}"
    return comp


@pytest.fixture(scope="module")
def reference():
    return run_jobs(1, [("single", reference_config(_main_cfg(), STEPS))])["single"]


def _record_logs(trainer):
    from deltacp.train.trainer import p2p_passings

    passings = p2p_passings(trainer.model)
    for p in passings:
        p.log = []
    return passings


def _auto_budget_gib(cfg, world):
    """A budget for which the auto plan checkpoints some but not all layers (found by asking the planner)."""
    import torch

    from deltacp.train.trainer import build_model, plan_checkpointing

    model = build_model(cfg, 0)

    def plan(gib):
        return plan_checkpointing(replace(cfg, activation_checkpointing="auto", activation_checkpointing_budget_gib=gib),
                                  model, torch.device("cpu"), 1, world)

    low, high = plan(1e-9).peak_bytes / 2 ** 30, plan(1e9).peak_bytes / 2 ** 30  # every layer full / none
    for i in range(1, 64):
        gib = low + (high - low) * i / 64
        found = plan(gib)
        if found.policy is not None and 0 < found.num_layers < found.total_layers:
            return gib, found
    raise AssertionError("no budget plans a partial checkpointing")


def _selective_and_auto(cfg, rows, logs_off, label) -> list[str]:
    """Selective activation checkpointing and auto (a budget that checkpoints some layers): the same first steps bit
    for bit as without, and the same p2p messages."""
    import torch.distributed as dist

    from deltacp.train.trainer import Trainer

    failures = []
    gib, plan = _auto_budget_gib(cfg, dist.get_world_size())
    variants = {"selective": replace(cfg, activation_checkpointing="selective"),
                "auto": replace(cfg, activation_checkpointing="auto", activation_checkpointing_budget_gib=gib)}
    for name, variant in variants.items():
        trainer = Trainer(variant, progress=False)
        passings = _record_logs(trainer)
        got = trainer.fit(1)
        logs = [list(p.log) for p in passings]
        got += trainer.fit(AC_STEPS - 1)
        keys = ("loss", "grad_norm")
        if [[r[k] for k in keys] for r in got] != [[r[k] for k in keys] for r in rows]:
            failures.append(f"{label}: AC {name} differs from AC off: {got} vs {rows}")
        if logs != logs_off:
            failures.append(f"{label}: p2p logs differ under AC {name}:\n{logs_off}\n{logs}")
        if name == "auto" and trainer.checkpointing_summary() != (
                f"auto: {plan.policy} {plan.num_layers}/{plan.total_layers} layers"):
            failures.append(f"{label}: auto applied {trainer.checkpointing_summary()}, planned {plan.describe()}")
    return failures


def cp4_worker(rank, world, results):
    from deltacp.train.trainer import Trainer

    failures = []
    for label, cfg in cp_configs(_main_cfg(), world, STEPS, MODES):
        trainer = Trainer(cfg, progress=False)
        passings = _record_logs(trainer)
        rows = trainer.fit(1)
        logs_off = [list(p.log) for p in passings]
        rows += trainer.fit()
        # Full activation checkpointing: same first steps, bit for bit, and the same p2p messages.
        ac = Trainer(replace(cfg, activation_checkpointing="full"), progress=False)
        passings = _record_logs(ac)
        rows_ac = ac.fit(1)
        logs_full = [list(p.log) for p in passings]
        rows_ac += ac.fit(AC_STEPS - 1)
        keys = ("loss", "grad_norm")
        if [[r[k] for k in keys] for r in rows_ac] != [[r[k] for k in keys] for r in rows[:AC_STEPS]]:
            failures.append(f"{label}: AC full differs from AC off: {rows_ac} vs {rows[:AC_STEPS]}")
        if logs_full != logs_off:
            failures.append(f"{label}: p2p logs differ under AC:\n{logs_off}\n{logs_full}")
        if cfg.accelerator.linear_attention_cp_mode == "p2p":
            failures += _selective_and_auto(cfg, rows[:AC_STEPS], logs_off, label)
            expected = ([f"recv H_in <-{rank - 1}"] if rank > 0 else []) + \
                       ([f"send H_out ->{rank + 1}", f"recv dH_out <-{rank + 1}"] if rank < world - 1 else []) + \
                       ([f"send dH_in ->{rank - 1}"] if rank > 0 else [])
            if len(logs_off) != 3 or any(log != expected for log in logs_off):
                failures.append(f"{label}: unexpected p2p messages {logs_off}, expected {expected} per layer")
        if rank == 0:
            results[label] = rows
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_cp4_main_config_every_mode_and_activation_checkpointing(reference):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        run_distributed(cp4_worker, 4, results, timeout_s=900)
        runs = dict(results)
    for label, rows in runs.items():
        assert len(rows) == STEPS
        comp = _check(reference, rows, label)
        print(f"{label}: max loss rel {comp['max_loss_rel']:.2e}, max grad-norm rel {comp['max_grad_norm_rel']:.2e}")


@pytest.mark.parametrize("world", [2, 8])
def test_cp2_cp8_every_mode_short(reference, world):
    runs = run_jobs(world, cp_configs(_main_cfg(), world, STEPS, MODES), timeout_s=600, max_steps=SHORT)
    for label, rows in runs.items():
        assert len(rows) == SHORT
        comp = _check(reference, rows, label)
        print(f"{label}: max loss rel {comp['max_loss_rel']:.2e}, max grad-norm rel {comp['max_grad_norm_rel']:.2e}")


def attention_cp_worker(rank, world, results):
    from functools import partial

    from deltacp.parallel.attention import kv_cp_attention_forward
    from deltacp.models.adapters import adapter_for
    from deltacp.train.trainer import Trainer

    base = _main_cfg()
    for u, method, layout in ((None, "all_gather", "contiguous"), (2, "ring", "contiguous"),
                              (None, "ring", "balanced")):
        acc = base.accelerator.replace(ulysses_degree=u, full_attention_cp=method, sequence_layout=layout,
                      linear_attention_state_passing="scan" if layout == "balanced" else "chain")
        label, cfg = cp_configs(replace(base, accelerator=acc), world, STEPS, ["p2p"])[0]
        trainer = Trainer(cfg, progress=False)
        installed = [layer.self_attn.forward for layer in adapter_for(trainer.model).layers()
                     if hasattr(layer, "self_attn")]
        assert installed and all(isinstance(f, partial) and f.func is kv_cp_attention_forward for f in installed)
        plan = installed[0].args[1]
        assert plan.method == method and (plan.ulysses_group is None if u is None else plan.ulysses_group.size() == u)
        rows = trainer.fit(SHORT)
        if rank == 0:
            results[f"{label}-{method}-u{u or 1}-{layout}"] = rows


def test_full_attention_cp_and_two_d_through_the_trainer(reference):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        run_distributed(attention_cp_worker, 4, results, timeout_s=600)
        runs = dict(results)
    assert len(runs) == 3
    for label, rows in runs.items():
        assert len(rows) == SHORT
        comp = _check(reference, rows, label)
        print(f"{label}: max loss rel {comp['max_loss_rel']:.2e}, max grad-norm rel {comp['max_grad_norm_rel']:.2e}")


def _kill_while_saving(step):
    if step == 6:
        import os

        os._exit(0)  # like a kill: no cleanup, the step-6 checkpoint is still a .tmp directory


def crash_worker(rank, world, cfg, results):
    from deltacp.train.trainer import Trainer, TrainHooks

    rows = Trainer(replace(cfg, checkpoint=CheckpointConfig()), progress=False).fit()
    if rank == 0:
        results["uninterrupted"] = rows
    Trainer(cfg, progress=False, hooks=TrainHooks(before_checkpoint_commit=_kill_while_saving)).fit()
    raise AssertionError("unreachable: the run is killed while saving step 6")


def resume_worker(rank, world, cfg, results):
    from deltacp.train.trainer import Trainer

    rows = Trainer(cfg, progress=False).fit()
    if rank == 0:
        results["resumed"] = rows


def test_kill_while_saving_then_resume_gives_the_same_losses(tmp_path):
    import torch.multiprocessing as mp

    ckpt = tmp_path / "ckpt"
    cfg = load_config(MAIN, ["train.steps=8", "train.accelerator.cp=2", "train.logging.progress=none",
                             f"train.checkpoint.dir={ckpt}", "train.checkpoint.interval=2", "train.checkpoint.keep=2"])
    with mp.Manager() as manager:
        results = manager.dict()
        run_distributed(crash_worker, 2, cfg, results, timeout_s=600)
        assert [s for s, _ in complete_checkpoints(ckpt)] == [2, 4]
        assert (ckpt / "step_00000006.tmp").is_dir()  # the interrupted save: present, never loaded
        run_distributed(resume_worker, 2, cfg, results, timeout_s=600)
        full, resumed = results["uninterrupted"], results["resumed"]
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in full[4:]]
    assert [s for s, _ in complete_checkpoints(ckpt)] == [6, 8]
    assert not list(ckpt.glob("*.tmp"))
