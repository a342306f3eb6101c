"""Errors the config, the data, the tokenizer or the checkpoint directory make certain are one line and exit 2
before any rank starts (`deltacp.train.preflight`), not a rank's failure after spawning. In-process: the spawn is
replaced by a stub that fails the test if it is ever reached with a bad config."""

import ast
import json
import os
from pathlib import Path

import pytest

from deltacp.train import cli
from test_train_parity import MAIN

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src" / "deltacp"


@pytest.fixture
def launches(monkeypatch):
    """The launches that got past the checks (the ranks are never started)."""
    started = []
    monkeypatch.setattr(cli, "spawn", lambda fn, world, cfg, *args: started.append(("spawn", world, cfg)))
    monkeypatch.setattr(cli, "run_rank", lambda cfg: started.append(("rank", None, cfg)))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return started


def refused(capsys, launches, *sets, spawn="2", cp=2) -> str:
    """The one stderr line of a launch that must stop before any rank starts (exit 2)."""
    args = ["--config", str(MAIN), "--set", f"train.accelerator.cp={cp}"]
    args += [x for s in sets for x in ("--set", s)] + (["--spawn", spawn] if spawn else [])
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert launches == [], "ranks were started"
    assert exc.value.code == 2 and len(err) == 1, err
    return err[0]


def test_a_good_config_gets_to_the_ranks(launches, capsys):
    cli.main(["--config", str(MAIN), "--spawn", "4"])
    assert [(kind, world) for kind, world, _ in launches] == [("spawn", 4)]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("sets, cp, words", [
    (["train.model.config.num_attention_heads=6"], 4,
     "with train.accelerator (cp=4 linear_attention_cp_mode=p2p): decoder layer 3 (full_attention): Ulysses full attention needs num_attention_heads (6) divisible by the CP "
     "degree (4)"),
    (["train.accelerator.linear_attention_cp_mode=ulysses", "train.model.config.linear_num_key_heads=2",
      "train.model.config.linear_num_value_heads=6"], 4,
     "with train.accelerator (cp=4): decoder layer 0 (linear_attention)"),
    (["train.model.config={}", "train.model.preset=0.8B"], 16,  # 8 attention heads
     ": decoder layer 3 (full_attention): Ulysses full attention needs num_attention_heads (8) divisible by the CP "
     "degree (16)"),
])
def test_a_model_the_cp_layout_cannot_split_is_refused_before_spawning(launches, capsys, sets, cp, words):
    line = refused(capsys, launches, *sets, spawn=str(cp), cp=cp)
    assert line.startswith("deltacp.train: config error: train.model ") and words in line, line


def test_device_and_precision_rules_are_checked_before_spawning(launches, capsys):
    import torch

    line = refused(capsys, launches, "train.dtype=bfloat16", "train.distributed.fsdp=false")
    assert line.startswith("deltacp.train: config error: train.dtype bfloat16 needs train.distributed.fsdp true"), line
    if not torch.cuda.is_available():
        line = refused(capsys, launches, "train.device=cuda")
        assert line == "deltacp.train: config error: train.device is 'cuda' but no CUDA device is available", line


def test_auto_checkpointing_on_cpu_needs_a_budget_in_gib(launches, capsys):
    line = refused(capsys, launches, "train.device=cpu", "train.activation_checkpointing=auto")
    assert line == ("deltacp.train: config error: train.activation_checkpointing=auto on cpu needs "
                    "train.activation_checkpointing_budget_gib (there is no device memory to take a fraction of)"), line
    cli.main(["--config", str(MAIN), "--set", "train.device=cpu", "--set", "train.activation_checkpointing=auto",
              "--set", "train.activation_checkpointing_budget_gib=2", "--spawn", "4"])
    assert [cfg.activation_checkpointing_budget_gib for _, _, cfg in launches] == [2.0]


def test_a_bad_sequence_layout_is_refused_before_spawning(launches, capsys):
    line = refused(capsys, launches, "train.accelerator.sequence_layout=zigzag")
    assert line.startswith("deltacp.train: config error: train.accelerator.sequence_layout='zigzag' is not "
                           "supported; expected one of ('contiguous', 'balanced')"), line
    line = refused(capsys, launches, "train.accelerator.sequence_layout=balanced", "train.data.seq_len=6")
    assert "with train.accelerator.sequence_layout='balanced'" in line, line
    cli.main(["--config", str(MAIN), "--set", "train.accelerator.sequence_layout=balanced", "--spawn", "4"])
    assert [cfg.accelerator.sequence_layout for _, _, cfg in launches] == ["balanced"]


def test_under_torchrun_every_rank_refuses_before_its_process_group(launches, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    line = refused(capsys, launches, "train.model.config.num_attention_heads=6", spawn=None, cp=4)
    assert "num_attention_heads (6) divisible by the CP degree (4)" in line, line


def test_one_process_says_how_to_start_ranks(launches, capsys):
    line = refused(capsys, launches, spawn=None, cp=4)
    assert "must divide the world size (1)" in line and "--spawn N" in line and "torchrun --nproc-per-node N" in line


def _jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_packed_documents_without_a_target_are_refused(launches, capsys, tmp_path):
    data = _jsonl(tmp_path / "one_token.jsonl", list("abcdefgh"))
    line = refused(capsys, launches, "train.data.source=files", f"train.data.paths=[{data}]", "train.data.packing=true")
    assert line.startswith(f"deltacp.train: config error: train.data.paths ['{data}'] hold no trainable target: "
                           f"every document has fewer than 2 tokens, and with train.data.packing true"), line


@pytest.mark.parametrize("files, entry, sets, words", [
    ({}, "missing.txt", [], "train.data.paths: '{d}/missing.txt' does not exist"),
    ({"a.jsonl": '{"text": "x"}\n'}, "", ["train.data.jsonl_field=body"],
     "train.data.jsonl_field='body': {d}/a.jsonl:1 has no string field 'body'"),
    ({"bad.jsonl": "not json\n"}, "", [], "train.data.paths: {d}/bad.jsonl:1 is not JSON"),
    ({"latin1.jsonl": b'{"text": "caf\xe9"}\n'}, "", [], "train.data.paths: {d}/latin1.jsonl is not UTF-8 text"),
    ({"a.jsonl": '{"text": "fine"}\n', "z/b.jsonl": "{}\n"}, "", [],  # a later file's first record too
     "train.data.jsonl_field='text': {d}/z/b.jsonl:1 has no string field 'text'"),
])
def test_data_errors_are_found_before_spawning(launches, capsys, tmp_path, files, entry, sets, words):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    line = refused(capsys, launches, "train.data.source=files", f"train.data.paths=[{tmp_path / entry}]", *sets)
    assert line.startswith("deltacp.train: config error: " + words.format(d=tmp_path)), line


def test_a_tokenizer_directory_without_a_tokenizer_names_the_key(launches, capsys, tmp_path):
    (tmp_path / "tok").mkdir()
    line = refused(capsys, launches, f"train.data.tokenizer={tmp_path / 'tok'}")
    assert line.startswith(f"deltacp.train: config error: train.data.tokenizer='{tmp_path / 'tok'}': no Hugging Face "
                           f"tokenizer could be loaded from this directory"), line


def test_an_unwritable_checkpoint_dir_names_the_key(launches, capsys, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    line = refused(capsys, launches, f"train.checkpoint.dir={tmp_path / 'file' / 'ckpt'}")
    assert line == (f"deltacp.train: config error: train.checkpoint.dir='{tmp_path / 'file' / 'ckpt'}' cannot be "
                    f"created: {tmp_path / 'file'} is not a directory"), line
    line = refused(capsys, launches, f"train.checkpoint.dir={tmp_path / 'file'}")
    assert line == f"deltacp.train: config error: train.checkpoint.dir='{tmp_path / 'file'}' is not a directory"
    # read-only: os.access is what the check asks (root passes permission bits, so a chmod would not show it)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    line = refused(capsys, launches, f"train.checkpoint.dir={tmp_path}")
    assert line.startswith(f"deltacp.train: config error: train.checkpoint.dir='{tmp_path}' is not writable"), line
    line = refused(capsys, launches, f"train.checkpoint.dir={tmp_path / 'new' / 'ckpt'}")
    assert line.startswith(f"deltacp.train: config error: train.checkpoint.dir='{tmp_path / 'new' / 'ckpt'}' cannot "
                           f"be created: {tmp_path} is not writable"), line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoint_dir_names_the_key(launches, capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ckpt.chmod(0o500)
    try:
        line = refused(capsys, launches, f"train.checkpoint.dir={ckpt}")
    finally:
        ckpt.chmod(0o700)
    assert line.startswith(f"deltacp.train: config error: train.checkpoint.dir='{ckpt}' is not writable"), line


def test_no_private_names_are_imported_across_train_modules():
    """Within deltacp.train a module imports only the public names of another (export used _load_failure)."""
    found = []
    for path in sorted((SRC / "train").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deltacp.train"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert found == []


def test_a_metrics_file_that_cannot_be_written_is_refused_before_spawning(launches, capsys, tmp_path, monkeypatch):
    """train.logging.metrics_file: a directory, or a file whose directory cannot be created, is one line before any
    rank starts (it used to fail at run time on rank 0); a missing directory that can be created is fine (rank 0
    creates it)."""
    (tmp_path / "file").write_text("")
    line = refused(capsys, launches, f"train.logging.metrics_file={tmp_path}")
    assert line == f"deltacp.train: config error: train.logging.metrics_file='{tmp_path}' is a directory; name a file " \
                   f"(JSON lines)", line
    target = tmp_path / "file" / "m.jsonl"
    line = refused(capsys, launches, f"train.logging.metrics_file={target}")
    assert line == (f"deltacp.train: config error: train.logging.metrics_file='{target}': its directory "
                    f"{tmp_path / 'file'} is not a directory"), line
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    line = refused(capsys, launches, f"train.logging.metrics_file={tmp_path / 'new' / 'm.jsonl'}")
    assert "its directory" in line and f"cannot be created: {tmp_path} is not writable" in line, line
    monkeypatch.setattr(os, "access", real_access)
    cli.main(["--config", str(MAIN), "--set", f"train.logging.metrics_file={tmp_path / 'new' / 'm.jsonl'}",
              "--spawn", "4"])
    assert len(launches) == 1


def test_progress_creates_the_metrics_files_directory(tmp_path):
    import io

    from deltacp.train.progress import Progress

    path = tmp_path / "a" / "b" / "m.jsonl"
    progress = Progress(1, mode="line", metrics_file=str(path), stream=io.StringIO())
    progress.metrics.close()
    assert path.exists()
