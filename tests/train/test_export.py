"""Export: a checkpoint trained at cp=2 becomes a transformers directory that plain
`Qwen3_5ForCausalLM.from_pretrained` reloads with the trained model's logits (bitwise, float32), and that
`train.model.pretrained` trains from; bad arguments are one line naming the setting."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from deltacp.distributed.launch import free_port, run_distributed
from deltacp.train.checkpoint import complete_checkpoints
from deltacp.train.config import load_config
from deltacp.train.export import main as export_main
from test_train_parity import MAIN

pytestmark = pytest.mark.fast

SMALL = ["train.logging.progress=none", "train.data.seq_len=64", "train.schedule.warmup_steps=1", "train.steps=3"]


def train_worker(rank, world, cfg, weights_file):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from deltacp.train.trainer import Trainer, with_cp

    trainer = Trainer(with_cp(cfg, world), progress=False)
    trainer.fit()  # saves the last step
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, weights_file)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cfg, checkpoint dir, the trained weights gathered from the cp=2 ranks) of a 3-step cp=2 run."""
    root = tmp_path_factory.mktemp("export")
    cfg = load_config(MAIN, SMALL + [f"train.checkpoint.dir={root / 'ckpt'}"])
    run_distributed(train_worker, 2, cfg, str(root / "weights.pt"), timeout_s=300)
    return cfg, root / "ckpt", torch.load(root / "weights.pt")


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The run directory exported (its newest checkpoint), float32."""
    cfg, ckpt, _ = trained
    out = tmp_path_factory.mktemp("exported") / "hf"
    _export(cfg, ckpt, out)
    return out


def _single_device_model(cfg, state=None):
    from deltacp.train.trainer import build_model

    model = build_model(cfg, 256)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


SEQUENCES = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 64, 129)]


def _logits(model):
    with torch.no_grad():
        return [model(input_ids=ids, use_cache=False).logits for ids in SEQUENCES]


def _export(cfg, checkpoint, out, *extra):
    export_main(["--config", str(MAIN), *(a for o in SMALL for a in ("--set", o)),
                 "--set", f"train.checkpoint.dir={cfg.checkpoint.dir}", "--checkpoint", str(checkpoint),
                 "--out", str(out), *extra])


def test_export_reloads_with_plain_from_pretrained_with_the_trained_logits(trained, exported, tmp_path, capsys):
    from transformers import Qwen3_5ForCausalLM

    cfg, ckpt, weights = trained
    (step, path), = complete_checkpoints(ckpt)
    assert step == 3 and json.loads((path / "manifest.json").read_text())["world_size"] == 2
    out = exported
    assert {"model.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]

    reloaded = Qwen3_5ForCausalLM.from_pretrained(out).eval()
    assert reloaded.dtype == torch.float32
    assert set(reloaded.state_dict()) == set(weights)
    trained_model = _single_device_model(cfg, weights)
    for ref, got in zip(_logits(trained_model), _logits(reloaded), strict=True):
        assert torch.equal(ref, got), (ref - got).abs().max()
    init = _single_device_model(cfg).state_dict()  # trained: the weights moved
    assert not torch.equal(init["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])

    out16 = tmp_path / "hf16"
    _export(cfg, path, out16, "--dtype", "bfloat16")  # one checkpoint (step_N)
    line = capsys.readouterr().out
    assert f"wrote {out16} (config.json, generation_config.json, model.safetensors) from {path}" in line
    bf16 = Qwen3_5ForCausalLM.from_pretrained(out16)
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    for name, tensor in bf16.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, weights[name].to(torch.bfloat16)), name


def test_training_starts_from_an_exported_directory(trained, exported):
    from deltacp.train.trainer import Trainer

    cfg, ckpt, weights = trained
    out = exported
    start = load_config(MAIN, SMALL + ["train.accelerator.cp=1", "train.model.config={}", "train.steps=1",
                                       f"train.model.pretrained={out}", "train.model.gate_init=default"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        trainer = Trainer(start, progress=False)
        for name, param in trainer.model.named_parameters():
            assert torch.equal(getattr(param, "full_tensor", lambda: param)(), weights[name]), name
        rows = trainer.fit()
    finally:
        dist.destroy_process_group()
    assert [r["step"] for r in rows] == [1] and torch.isfinite(torch.tensor(rows[0]["loss"]))


def test_bad_arguments_are_one_line_naming_the_setting(trained, tmp_path, capsys):
    cfg, ckpt, _ = trained
    (tmp_path / "file").write_text("x")
    cases = [  # (--checkpoint, --out, exit code, text of the line)
        (tmp_path / "missing", tmp_path / "a", 1, f"--checkpoint={str(tmp_path / 'missing')!r}: no such directory"),
        (tmp_path, tmp_path / "a", 1, "nor a directory holding complete checkpoints"),
        (ckpt, tmp_path, 2, f"--out={str(tmp_path)!r} is a directory that is not empty"),
    ]
    for checkpoint, out, code, text in cases:
        with pytest.raises(SystemExit) as exc:
            _export(cfg, checkpoint, out)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == code and text in err and "\n" not in err, (code, err)
    with pytest.raises(SystemExit) as exc:  # a checkpoint of another model
        _export(cfg, ckpt, tmp_path / "b", "--set", "train.model.config.intermediate_size=96")
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1 and "does not fit train.model" in err and ".mlp." in err and "\n" not in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob("*.partial-*"))


def test_a_local_tokenizer_is_written_with_the_model(trained, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg, ckpt, _ = trained
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(["def", "return", "x", "(", ")", ":"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path / "tok")
    _export(cfg, ckpt, tmp_path / "hf", "--set", f"train.data.tokenizer={tmp_path / 'tok'}")
    written = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert written("def x ( ) : return x")["input_ids"] == [2, 4, 5, 6, 7, 3, 4]
    assert written.eos_token == "</s>"


def test_a_killed_exports_partial_directory_is_removed_by_the_next(trained, tmp_path):
    """An export killed mid-write leaves `out.partial-PID`; the next export to `out` removes it once that process is
    gone, and leaves a live process's one (another export writing now) alone."""
    import subprocess
    import sys

    cfg, ckpt, _ = trained
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its PID no longer runs
    stale, live = tmp_path / f"hf.partial-{gone.pid}", tmp_path / f"hf.partial-{os.getppid()}"
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half written")
    _export(cfg, ckpt, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").exists()
    assert not stale.exists() and live.exists()
