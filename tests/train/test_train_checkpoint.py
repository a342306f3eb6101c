"""Checkpoint faults: corrupted or mismatched checkpoints are one-line errors naming the file and the cause;
a run never deletes or silently resumes another run's checkpoints; a checkpoint resumes at another CP size.

Most tests run the trainer in this process on a 1-rank gloo group (cp=1: no spawn start-up cost)."""

import os
import shutil
from dataclasses import replace

import pytest
import torch.distributed as dist

from deltacp.distributed.launch import free_port, run_distributed
from deltacp.train.checkpoint import MANIFEST, RUN_FILE, CheckpointError, complete_checkpoints, read_json
from deltacp.train.cli import describe_failure, main
from deltacp.train.config import CheckpointConfig, ConfigError, load_config
from test_train_parity import MAIN
from test_train_preflight import launches, refused  # noqa: F401  (a fixture)

SMALL = ["train.logging.progress=none", "train.data.seq_len=64", "train.schedule.warmup_steps=2"]


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cfg(ckpt, *overrides):
    return load_config(MAIN, SMALL + ["train.accelerator.cp=1", f"train.checkpoint.dir={ckpt}", *overrides])


def _fit(cfg, max_steps=None):
    from deltacp.train.trainer import Trainer

    return Trainer(cfg, progress=False).fit(max_steps)


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory):
    """A 2-step run's checkpoint directory (copy it before changing it)."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    _fit(_cfg(ckpt, "train.steps=2"))
    return ckpt


def _one_line_error(exc_info) -> str:
    line = describe_failure(exc_info.value, 0, None)
    assert "\n" not in line and "CheckpointException" not in line and "Traceback" not in line, line
    return line


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.fast
@pytest.mark.parametrize("damage, name, cause", [
    (_flip_byte, "__0_0.distcp", "is corrupted: sha256"),
    (_truncate, "__0_0.distcp", "is truncated"),
    (_truncate, ".metadata", "is truncated"),
    (_flip_byte, "trainer_rank0.pt", "is corrupted: sha256"),
    (os.remove, MANIFEST, f"has no {MANIFEST}"),
    (_truncate, MANIFEST, f"{MANIFEST}: unreadable"),
])
def test_damaged_checkpoint_is_one_line_naming_the_file(one_rank, saved, tmp_path, damage, name, cause):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (_, path), = complete_checkpoints(ckpt)
    damage(path / name)
    with pytest.raises(CheckpointError) as exc:
        _fit(_cfg(ckpt, "train.steps=3"))
    line = _one_line_error(exc)
    assert str(path / name) in line or (name == MANIFEST and str(path) in line), line
    assert cause in line, line


@pytest.mark.fast
def test_a_newest_checkpoint_without_metadata_is_refused_not_skipped(one_rank, saved, tmp_path):
    from deltacp.train.export import resolve_checkpoint
    from deltacp.train.trainer import plan_checkpoint_dir

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    shutil.copytree(ckpt / "step_00000002", ckpt / "step_00000001")  # an older complete checkpoint
    (ckpt / "step_00000002" / ".metadata").unlink()
    words = (f"checkpoint file {ckpt / 'step_00000002' / '.metadata'} is missing (the newest checkpoint in {ckpt} is "
             f"damaged")
    with pytest.raises(CheckpointError) as exc:  # the ranks (a Trainer without the launcher): every rank alike
        _fit(_cfg(ckpt, "train.steps=3"))
    line = _one_line_error(exc)
    assert words in line and f"or delete it to resume from {ckpt / 'step_00000001'}" in line, line
    assert not (ckpt / "step_00000003").exists()
    plan = plan_checkpoint_dir(_cfg(ckpt))  # rank 0's verdict, broadcast: it must not raise on rank 0 alone
    assert words in plan["damaged"] and plan["resume"] is None
    with pytest.raises(CheckpointError, match="is missing .the newest checkpoint"):  # export takes the newest too
        resolve_checkpoint(_cfg(ckpt), ckpt)


@pytest.mark.fast
def test_resume_after_the_model_changed_names_checkpoint_and_cause(one_rank, saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    with pytest.raises(CheckpointError) as exc:
        _fit(_cfg(ckpt, "train.steps=3", "train.model.config.hidden_size=32"))
    line = _one_line_error(exc)
    assert f"checkpoint {ckpt / 'step_00000002'}: load failed: ValueError: Size mismatch" in line, line
    assert "embed_tokens" in line and "train.model" in line, line


def test_a_run_never_deletes_or_resumes_another_runs_checkpoints(one_rank, tmp_path):
    from deltacp.train.trainer import Trainer

    ckpt = tmp_path / "ckpt"
    first = _cfg(ckpt, "train.steps=6", "train.checkpoint.interval=1", "train.checkpoint.keep=2")
    a = Trainer(first, progress=False)
    a.fit(2)
    run_a = read_json(ckpt / RUN_FILE)["run_id"]
    assert [s for s, _ in complete_checkpoints(ckpt)] == [1, 2] and a.run_id == run_a
    assert all(read_json(p / MANIFEST)["run_id"] == run_a for _, p in complete_checkpoints(ckpt))

    # resume: false into a directory with another run's checkpoints: refused, nothing touched.
    with pytest.raises(ConfigError) as exc:
        _fit(replace(first, checkpoint=replace(first.checkpoint, resume=False)))
    line = _one_line_error(exc)
    for words in (f"train.checkpoint.dir={str(ckpt)!r} holds 2 checkpoint(s) of run {run_a}",
                  "train.checkpoint.resume is false", "train.checkpoint.overwrite=true"):
        assert words in line, line
    assert [s for s, _ in complete_checkpoints(ckpt)] == [1, 2]

    # resume: true continues run A (same run id); the directory is now this process's: A's trainer may not save.
    cont = Trainer(first, progress=False)
    assert [r["step"] for r in cont.fit(1)] == [3] and cont.run_id == run_a
    with pytest.raises(CheckpointError, match=f"was claimed by another process since this run started .run {run_a},"):
        a.fit(1)

    # overwrite: true deletes them, and the directory belongs to the new run B ...
    b = Trainer(replace(first, checkpoint=replace(first.checkpoint, resume=False, overwrite=True)), progress=False)
    b.fit(1)
    run_b = read_json(ckpt / RUN_FILE)["run_id"]
    assert run_b not in (None, run_a) and [s for s, _ in complete_checkpoints(ckpt)] == [1]
    # ... so run A, still running, refuses to save into it (and its retention deletes nothing of B's).
    with pytest.raises(CheckpointError, match=f"was claimed by another process since this run started .run {run_b},"):
        cont.fit(1)
    assert [s for s, _ in complete_checkpoints(ckpt)] == [1]
    assert read_json(ckpt / "step_00000001" / MANIFEST)["run_id"] == run_b


@pytest.mark.fast
def test_overwrite_needs_resume_false():
    with pytest.raises(ConfigError, match=r"^train\.checkpoint\.overwrite=true needs train\.checkpoint\.resume=false"):
        load_config(MAIN, ["train.checkpoint.overwrite=true"])


@pytest.mark.fast
def test_a_backend_other_than_the_process_groups_is_an_error(one_rank):
    from deltacp.train.trainer import Trainer

    cfg = load_config(MAIN, SMALL + ["train.accelerator.cp=1", "train.distributed.backend=nccl", "train.device=cpu"])
    with pytest.raises(ConfigError, match=r"^train\.distributed\.backend is 'nccl' but this process group uses 'gloo'"):
        Trainer(cfg, progress=False)


# -- resume at another CP size ----------------------------------------------------------------------------------


def save_at_cp2_worker(rank, world, cfg):
    from deltacp.train.trainer import Trainer, with_cp

    Trainer(with_cp(cfg, world), progress=False).fit(4)  # saves step 4 (interval 4), stops there


def resume_at_cp4_worker(rank, world, cfg, results):
    from deltacp.train.trainer import Trainer, with_cp

    cfg = replace(cfg, accelerator=cfg.accelerator.replace(sequence_layout="balanced"))  # saved: contiguous
    full = Trainer(with_cp(replace(cfg, checkpoint=CheckpointConfig()), world), progress=False).fit()
    trainer = Trainer(with_cp(cfg, world), progress=False)
    messages = []
    trainer.progress.message = messages.append
    resumed = trainer.fit()
    if rank == 0:
        results["full"], results["resumed"], results["messages"] = full, resumed, messages


def test_a_cp2_checkpoint_resumes_at_cp4_with_the_losses_of_an_uninterrupted_cp4_run(tmp_path):
    """Saved at cp2 (contiguous), resumed at cp4 under the balanced layout: the losses of an uninterrupted cp4
    balanced run, and the resume says what changed (mutation seen failing: the layout left out of the trainer
    state, no word of the change)."""
    import torch.multiprocessing as mp

    ckpt = tmp_path / "ckpt"
    cfg = load_config(MAIN, SMALL + ["train.steps=8", f"train.checkpoint.dir={ckpt}", "train.checkpoint.interval=4"])
    run_distributed(save_at_cp2_worker, 2, cfg, timeout_s=300)
    assert [s for s, _ in complete_checkpoints(ckpt)] == [4]
    assert read_json(ckpt / "step_00000004" / MANIFEST)["world_size"] == 2
    with mp.Manager() as manager:
        results = manager.dict()
        run_distributed(resume_at_cp4_worker, 4, cfg, results, timeout_s=300)
        full, resumed, messages = results["full"], results["resumed"], list(results["messages"])
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert any("(step 4, resharded from dp1xcp2 to dp1xcp4, sequence_layout changed from 'contiguous' to "
               "'balanced')" in m for m in messages), messages
    for ref, row in zip(full[4:], resumed, strict=True):  # same weights, optimizer, data; cp2 vs cp4 rounding only
        assert abs(row["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (ref, row)
        assert abs(row["grad_norm"] - ref["grad_norm"]) <= 1e-4 * abs(ref["grad_norm"]), (ref, row)
        assert row["lr"] == ref["lr"]
    assert read_json(ckpt / "step_00000008" / MANIFEST)["world_size"] == 4


# -- the same checkpoint errors, before any rank starts ----------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("change, sets, words", [
    (None, [], None),  # a checkpoint this run can resume gets to the ranks
    (lambda p: _truncate(p / "__0_0.distcp"), [], "checkpoint error: checkpoint file {p}/__0_0.distcp is truncated"),
    (lambda p: os.remove(p / MANIFEST), [], f"checkpoint error: checkpoint {{p}} has no {MANIFEST}"),
    (lambda p: os.remove(p / ".metadata"), [], "checkpoint error: checkpoint file {p}/.metadata is missing (the newest "
                                                "checkpoint in {c} is damaged"),
    (None, ["train.model.config.hidden_size=32"],
     "checkpoint error: checkpoint {p} does not fit train.model of this config: it has lm_head.weight of shape "
     "[256, 64], this model [256, 32]"),
    (None, ["train.checkpoint.resume=false"], "config error: train.checkpoint.dir='{c}' holds 1 checkpoint(s) of run"),
    (None, ["train.seed=1"], "checkpoint error: checkpoint {p} does not fit train.seed / train.data of this config: "
                             "its data stream is seed 0 over "),
])
def test_checkpoint_errors_are_found_before_spawning(saved, tmp_path, launches, capsys, change, sets, words):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    path = ckpt / "step_00000002"
    if change is not None:
        change(path)
    args = [*SMALL, "train.accelerator.cp=1", f"train.checkpoint.dir={ckpt}", "train.steps=3", *sets]
    if words is None:
        main(["--config", str(MAIN), "--spawn", "1", *[x for a in args for x in ("--set", a)]])
        assert len(launches) == 1 and capsys.readouterr().err == ""
        return
    line = refused(capsys, launches, *args, spawn="1", cp=1)
    assert line.startswith("deltacp.train: " + words.format(p=path, c=ckpt)), line


def test_resuming_with_other_train_steps_says_the_schedule_is_replanned(one_rank, saved, tmp_path):
    """The learning-rate schedule is a function of train.steps: a resume with another value says so, with the lr at
    the resumed step under both plans (it was silent; mutation seen failing: the message removed)."""
    from deltacp.train.trainer import Trainer, lr_lambda

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    cfg = _cfg(ckpt, "train.steps=6")
    trainer = Trainer(cfg, progress=False)
    messages = []
    trainer.progress.message = messages.append
    trainer.fit(1)
    old, new = (cfg.optimizer.lr * lr_lambda(replace(cfg, steps=n), 2) for n in (2, 6))
    assert any(f"train.steps changed from 2 to 6 since the checkpoint: the learning-rate schedule (cosine) is "
               f"re-planned over 6 steps (lr at step 2: {old:.3e} under the old plan, {new:.3e} under the new)" in m
               for m in messages), messages
