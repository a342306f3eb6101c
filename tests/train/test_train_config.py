"""Trainer config validation: every rule gives its documented error, naming the key."""

import re
from pathlib import Path

import pytest
import torch

from deltacp.train.config import ConfigError, config_from_dict, config_to_dict, load_config

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "configs" / "tiny_cp4.yaml"


def _load(*overrides):
    return load_config(MAIN, list(overrides))


def test_main_config_loads_and_round_trips():
    cfg = _load()
    assert cfg.accelerator.cp == 4 and cfg.model.config["hidden_size"] == 64
    assert config_from_dict(config_to_dict(cfg)) == cfg
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


@pytest.mark.parametrize("override, error, pattern", [
    ("train.optimizer.lr2=1", ConfigError, r"^train\.optimizer\.lr2: unknown key"),
    ("train.stepz=3", ConfigError, r"^train\.stepz: unknown key"),
    ("train.model.config.hiden_size=3", ConfigError, r"^train\.model\.config\.hiden_size: unknown Qwen3_5TextConfig"),
    ("train.accelerator.cpp=4", ValueError, r"train\.accelerator: unknown key\(s\) \['cpp'\]"),
    ("train.accelerator.linear_attention_cp_mode=ring", ValueError,
     r"train\.accelerator\.linear_attention_cp_mode='ring' is not supported"),
    ("train.accelerator.linear_attention_backend=auto", ValueError,
     r"train\.accelerator\.linear_attention_backend='auto' is not supported"),
    ("train.accelerator.tp=2", ValueError, r"train\.accelerator\.tp=2 is not supported .*tp must be 1"),
    ("train.accelerator.ulysses_degree=3", ValueError, r"train\.accelerator\.ulysses_degree=3 is not supported at "
                                                       r"cp=4"),
    ("train.accelerator.full_attention_cp=zigzag", ValueError,
     r"train\.accelerator\.full_attention_cp='zigzag' is not supported"),
    ("train.data.seq_len=510", ConfigError, r"train\.data\.seq_len \(510\) must be divisible by train\.accelerator\.cp \(4\)"),
    ("train.accelerator.sequence_layout=zigzag", ValueError,
     r"train\.accelerator\.sequence_layout='zigzag' is not supported; expected one of \('contiguous', 'balanced'\)"),
    ("train.dtype=float16", ConfigError, r"train\.dtype='float16' is not supported"),
    ("train.activation_checkpointing=partial", ConfigError, r"train\.activation_checkpointing='partial' is not "
                                                            r"supported; expected one of \['none', 'full', "
                                                            r"'selective', 'auto'\]"),
    ("train.activation_checkpointing_budget_gib=40", ConfigError,
     r"^train\.activation_checkpointing_budget_gib is read by train\.activation_checkpointing=auto only, not 'none'"),
    ("train.activation_checkpointing_budget_fraction=0.5", ConfigError,
     r"^train\.activation_checkpointing_budget_fraction is read by train\.activation_checkpointing=auto only"),
    ("train.optimizer.lr=fast", ConfigError, r"train\.optimizer\.lr must be a number"),
    ("train.steps=0", ConfigError, r"train\.steps must be > 0"),
    ("train.schedule.kind=linear", ConfigError, r"train\.schedule\.kind='linear' is not supported"),
    ("train.checkpoint.resume=maybe", ConfigError, r"train\.checkpoint\.resume must be true or false"),
    ("train.optimizer.grad_clip=.nan", ConfigError, r"^train\.optimizer\.grad_clip must be a finite number, got nan"),
    ("train.optimizer.lr=.inf", ConfigError, r"^train\.optimizer\.lr must be a finite number, got inf"),
    ("train.optimizer.lr=nan", ConfigError, r"^train\.optimizer\.lr must be a finite number, got nan"),
    ("train.optimizer.weight_decay=-.inf", ConfigError, r"^train\.optimizer\.weight_decay must be a finite number"),
    ("train.distributed.timeout_s=.nan", ConfigError, r"^train\.distributed\.timeout_s must be a finite number"),
    ("train.optimizer.betas=[0.9, .nan]", ConfigError, r"^train\.optimizer\.betas must be two numbers in \[0, 1\)"),
    ("train.model.config.rms_norm_eps=.nan", ConfigError, r"^train\.model\.config\.rms_norm_eps must be a finite number"),
    ("train.model.attn_implementation=eager", ConfigError,
     r"^train\.model\.attn_implementation: unknown key \(removed: the trainer always applies CP"),
    ("train.model.config.attn_implementation=eager", ConfigError,
     r"^train\.model\.config\.attn_implementation: unknown key \(removed"),
])
def test_bad_values_name_the_key(override, error, pattern):
    with pytest.raises(error, match=pattern):
        _load(override)


def test_activation_checkpointing_budget():
    for mode in ("full", "selective", "auto"):
        assert _load(f"train.activation_checkpointing={mode}").activation_checkpointing == mode
    cfg = _load("train.activation_checkpointing=auto", "train.activation_checkpointing_budget_gib=40")
    assert cfg.activation_checkpointing_budget_gib == 40.0 and config_from_dict(config_to_dict(cfg)) == cfg
    auto = "train.activation_checkpointing=auto"
    with pytest.raises(ConfigError, match="both given: give one budget"):
        _load(auto, "train.activation_checkpointing_budget_gib=40", "train.activation_checkpointing_budget_fraction=.5")
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing_budget_gib must be > 0, got 0"):
        _load(auto, "train.activation_checkpointing_budget_gib=0")
    with pytest.raises(ConfigError, match=re.escape("train.activation_checkpointing_budget_fraction must be in (0, 1], "
                                                    "got 1.5")):
        _load(auto, "train.activation_checkpointing_budget_fraction=1.5")


def test_sequence_layout():
    assert _load().accelerator.sequence_layout == "contiguous"
    cfg = _load("train.accelerator.sequence_layout=balanced")
    assert cfg.accelerator.sequence_layout == "balanced" and config_from_dict(config_to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match=re.escape("train.data.seq_len (36) must be divisible by 2 x "
                                                    "train.accelerator.cp (8) with "
                                                    "train.accelerator.sequence_layout='balanced'")):
        _load("train.accelerator.sequence_layout=balanced", "train.data.seq_len=36")
    _load("train.data.seq_len=36")  # contiguous: divisible by cp is enough
    # the conv halo must fit in every piece: 16 tokens at cp 4 are pieces of 4 (contiguous) or 2 (balanced)
    _load("train.accelerator.linear_attention_cp_mode=p2p", "train.data.seq_len=16")
    with pytest.raises(ConfigError, match=re.escape("train.data.seq_len (16) / 8 pieces (cp 4, sequence_layout "
                                                    "'balanced') is below the conv halo (3 tokens)")):
        _load("train.accelerator.linear_attention_cp_mode=p2p", "train.accelerator.sequence_layout=balanced",
              "train.data.seq_len=16")


def test_all_gather_with_triton_is_not_implemented():
    with pytest.raises(NotImplementedError, match="all_gather"):
        _load("train.accelerator.linear_attention_cp_mode=all_gather",
              "train.accelerator.linear_attention_backend=triton")


def test_world_size_rules():
    cfg = _load()
    cfg.validate_world(4)
    # dp derived as world // cp: 8 ranks at cp 4 are dp 2, whose global batch must split into 2 groups
    with pytest.raises(ConfigError, match=re.escape("train.data.batch_size (1) must be divisible by "
                                                    "train.accelerator.dp (2, derived as world // cp)")):
        cfg.validate_world(8)
    _load("train.data.batch_size=2").validate_world(8)
    with pytest.raises(ValueError, match=re.escape("train.accelerator.dp (2) x cp (4) x tp (1) = 8 must equal the "
                                                   "world size (4)")):
        _load("train.data.batch_size=2", "train.accelerator.dp=2").validate_world(4)
    with pytest.raises(ConfigError, match=re.escape("train.data.batch_size (3) must be divisible by "
                                                    "train.accelerator.dp (2)")):
        _load("train.data.batch_size=3", "train.accelerator.dp=2")
    with pytest.raises(ValueError, match=re.escape("train.accelerator.dp must be null or an integer >= 1")):
        _load("train.accelerator.dp=0")
    with pytest.raises(ValueError, match=re.escape("cp (4) x tp (1) must divide the world size (6)")):
        cfg.validate_world(6)


def test_cli_reports_config_errors_in_one_line(capsys):
    from deltacp.train.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--config", str(MAIN), "--set", "train.optimizer.lr2=1", "--spawn", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deltacp.train: config error: train.optimizer.lr2: unknown key")


def test_nccl_with_spawn_is_a_config_error(capsys):
    from deltacp.train.cli import main

    with pytest.raises(SystemExit) as exc:  # --spawn runs gloo CPU ranks: it must not silently replace nccl
        main(["--config", str(MAIN), "--set", "train.distributed.backend=nccl", "--spawn", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deltacp.train: config error: train.distributed.backend='nccl' cannot "
                                               "be used with --spawn"), err


@pytest.mark.parametrize("files", [
    {"empty.txt": ""},
    {"a.txt": "", "b.md": " \n\n\t", "c.py": ""},
    {"docs.jsonl": '{"text": ""}\n{"text": "  "}\n'},
])
def test_data_without_usable_text_is_an_error(tmp_path, files):
    from deltacp.train.data import TokenStream

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cfg = _load("train.data.source=files", f"train.data.paths=[{tmp_path}]")
    with pytest.raises(ConfigError, match=r"^train\.data\.paths .* hold no usable text"):
        TokenStream(cfg.data, 0)


def test_data_stream_refuses_to_stream_separators_forever(tmp_path):
    from deltacp.train.data import TokenStream

    (tmp_path / "a.txt").write_text("usable text")
    cfg = _load("train.data.source=files", f"train.data.paths=[{tmp_path}]", "train.data.seq_len=64")
    stream = TokenStream(cfg.data, 0)
    (tmp_path / "a.txt").write_text("")  # emptied after the start-up check
    with pytest.raises(ConfigError, match=r"^train\.data: the 1 data file\(s\) hold no usable text"):
        for _ in range(10):
            stream.next_batch()


def test_packed_documents_without_a_target_are_refused(tmp_path):
    """Packed, no target crosses a document boundary: documents of one token each would train on nothing (loss 0,
    grad norm 0)."""
    from deltacp.train.data import TokenStream

    (tmp_path / "one_token.jsonl").write_text("".join(f'{{"text": "{c}"}}\n' for c in "abcdefgh"))
    sets = ["train.data.source=files", f"train.data.paths=[{tmp_path}]", "train.data.packing=true"]
    with pytest.raises(ConfigError, match=r"^train\.data\.paths \[.*\] hold no trainable target: every document has "
                                          r"fewer than 2 tokens, and with train\.data\.packing true"):
        TokenStream(_load(*sets).data, 0)
    TokenStream(_load(*sets[:2], "train.data.packing=false").data, 0)  # a separator follows every document
    (tmp_path / "more.jsonl").write_text('{"text": "ab"}\n')  # one document of 2 tokens gives a target
    TokenStream(_load(*sets).data, 0)


def test_jsonl_without_the_field_names_the_key(tmp_path):
    from deltacp.train.data import TokenStream

    (tmp_path / "docs.jsonl").write_text('{"body": "text"}\n')
    cfg = _load("train.data.source=files", f"train.data.paths=[{tmp_path}]")
    with pytest.raises(ConfigError, match=r"^train\.data\.jsonl_field='text': .*docs\.jsonl:1 has no string field"):
        TokenStream(cfg.data, 0)


def test_data_stream_is_deterministic_and_resumable():
    from deltacp.train.data import TokenStream

    cfg = _load("train.data.seq_len=64")
    a, b = TokenStream(cfg.data, 0), TokenStream(cfg.data, 0)
    first = [a.next_batch() for _ in range(3)]
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(200)]  # crosses file boundaries
    b.load_state_dict(state)
    assert all((x == y).all() for x, y in zip(rest, [b.next_batch() for _ in range(200)]))
    c = TokenStream(cfg.data, 0)
    assert all((x == c.next_batch()).all() for x in first)
    assert not (TokenStream(cfg.data, 1).next_batch() == first[0]).all()  # the seed picks the order
    assert first[0].shape == (1, 64) and int(first[0].max()) < 256


def test_lr_schedule():
    from deltacp.train.trainer import lr_lambda

    cfg = _load("train.steps=100", "train.schedule.warmup_steps=10", "train.schedule.min_lr_ratio=0.1")
    assert lr_lambda(cfg, 0) == pytest.approx(0.1) and lr_lambda(cfg, 9) == pytest.approx(1.0)
    assert lr_lambda(cfg, 10) == pytest.approx(1.0) and lr_lambda(cfg, 100) == pytest.approx(0.1)
    const = _load("train.schedule.kind=constant", "train.schedule.warmup_steps=0")
    assert lr_lambda(const, 57) == 1.0


def test_builtin_png_writer(tmp_path):
    from deltacp.train.plot import _write_builtin

    path = tmp_path / "p.png"
    _write_builtin(path, [("loss", {"a": [(1, 1.0), (2, 0.5)]}, False),
                          ("rel", {"a": [(1, 1e-7), (2, 1e-10)]}, True)], "T", {"a": (255, 0, 0)})
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82")


def test_packed_rows_hold_whole_documents_and_their_offsets(tmp_path):
    from deltacp.train.data import TokenStream

    lengths = [5, 1, 30, 2, 70, 0, 9]  # bytes; the empty document is skipped
    docs = [bytes([97 + i]) * n for i, n in enumerate(lengths)]
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "{d.decode()}"}}\n' for d in docs))
    cfg = _load("train.data.source=files", f"train.data.paths=[{tmp_path}]", "train.data.seq_len=32",
                "train.data.packing=true")
    stream = TokenStream(cfg.data, 0)
    rows = [stream.next_packed_row() for _ in range(4)]
    ids = torch.cat([r[0] for r in rows], dim=1)[0]
    # 117 tokens of text, then the stream starts over (epoch 1): the documents appear in order, no separators
    text = b"".join(docs)
    assert bytes(ids[: len(text)].tolist()) == text
    for row, cu in rows:
        assert row.shape == (1, 32) and cu[0] == 0 and cu[-1] == 32 and bool((cu[1:] > cu[:-1]).all())
        # every document of a row is one byte value (one source document, or a piece of one)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert len(set(row[0, a:b].tolist())) == 1
    # the document ends inside the first row: after 5, 6 and 32 (the 30-byte document continues in row 2)
    assert rows[0][1].tolist() == [0, 5, 6, 32]
    assert rows[1][1].tolist() == [0, 4, 6, 32]
    _load("train.data.packing=true", "train.data.batch_size=2")  # two packed rows per step (one per dp group at dp 2)


def test_long_memory_gates_on_a_pretrained_model_are_refused(tmp_path):
    from deltacp.train.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("train:\n  model: {pretrained: /some/dir, gate_init: long_memory}\n")
    with pytest.raises(ConfigError, match=r"train\.model\.gate_init='long_memory' would overwrite the gates"):
        load_config(path, [])


def test_presets_are_the_released_shapes():
    """The 9B preset is transformers' default Qwen3_5TextConfig (the released 9B text model) up to the rope theta
    and context of the release; every size builds and has its published text-model parameter count."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltacp.models.presets import QWEN3_5_PRESETS, qwen3_5_preset

    default = Qwen3_5TextConfig().to_dict()
    nine = Qwen3_5TextConfig(**qwen3_5_preset("9B")).to_dict()
    differ = sorted(k for k in default if k not in ("rope_parameters", "max_position_embeddings") and
                    default[k] != nine[k])
    assert differ == [], differ
    billions = {}
    for size in QWEN3_5_PRESETS:
        with torch.device("meta"):
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**qwen3_5_preset(size)))
        billions[size] = round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
        assert model.config.vocab_size == 248_320 and model.config.layer_types[3::4] == ["full_attention"] * (
            model.config.num_hidden_layers // 4)
    assert billions == {"0.8B": 0.75, "2B": 1.88, "4B": 4.21, "9B": 8.95, "27B": 26.9}
    with pytest.raises(ValueError, match=r"preset '3B' is not known; expected one of \('0\.8B'"):
        qwen3_5_preset("3B")


def test_trainer_preset_with_overrides():
    from deltacp.train.config import model_config_fields

    cfg = _load("train.model.config={num_hidden_layers: 4, vocab_size: 256}", "train.model.preset=2B")
    fields = model_config_fields(cfg.model)
    assert fields["hidden_size"] == 2048 and fields["vocab_size"] == 256 and fields["num_hidden_layers"] == 4
    assert fields["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(ConfigError, match=r"^train\.model\.preset='2b' is not known; expected one of \['0\.8B'"):
        _load("train.model.preset=2b")
    with pytest.raises(ConfigError, match=r"^train\.model\.preset: the presets are the dense Qwen3\.5 sizes .* not "
                                          r"Qwen3NextForCausalLM"):
        _load("train.model.preset=2B", "train.model.model_class=Qwen3NextForCausalLM")
    with pytest.raises(ConfigError, match=r"give either pretrained .* or preset/config"):
        _load("train.model.config={}", "train.model.preset=2B", "train.model.pretrained=/nonexistent")


def test_a_config_error_comes_before_the_heavy_imports():
    """`python -m deltacp.train` with a bad key: the error, exit 2, and neither transformers' models nor
    torch.distributed's checkpoint code imported (mutation seen failing: cli.py importing preflight at the top)."""
    import subprocess
    import sys

    code = ("import sys\nfrom deltacp.train.cli import main\ntry:\n    main(['--config', %r, '--set', "
            "'train.optimizer.lr2=1'])\nexcept SystemExit as e:\n    heavy = [m for m in ('transformers.models.qwen3_5."
            "modeling_qwen3_5', 'torch.distributed.checkpoint', 'deltacp.train.trainer') if m in sys.modules]\n"
            "    print('HEAVY', heavy, 'EXIT', e.code)\n" % str(MAIN))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY [] EXIT 2" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "train.optimizer.lr2: unknown key" in out.stderr


def test_a_pretrained_override_replaces_the_files_field_model(tmp_path):
    """Fine-tuning the main config's setup from an export: `--set train.model.pretrained=DIR` alone (the file's
    config fields and gate_init describe a model built from fields; the directory's config.json replaces them)."""
    cfg = _load(f"train.model.pretrained={tmp_path}")
    assert cfg.model.pretrained == str(tmp_path) and cfg.model.config == {} and cfg.model.gate_init == "default"
    # set explicitly next to pretrained, they are still refused by name
    with pytest.raises(ConfigError, match="gate_init='long_memory' would overwrite the gates"):
        _load(f"train.model.pretrained={tmp_path}", "train.model.gate_init=long_memory")
    with pytest.raises(ConfigError, match="give either pretrained"):
        _load(f"train.model.pretrained={tmp_path}", "train.model.config.hidden_size=32")
    # pretrained=null names no directory: the file's model stays as it is
    assert _load("train.model.pretrained=null") == _load()
