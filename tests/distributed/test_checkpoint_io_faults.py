"""The fault trial's checkpoint cases (2026-12-05): load_pretrained / save_pretrained never load the wrong weights,
never lose an export, and raise file errors on every rank together. One 2-rank spawn, plus one-process cases.

- shards of an older save beside an index and its shards: the index's files are read (every *.safetensors was);
  a stale model.safetensors beside an index is refused (it was loaded; transformers reads it, ignoring the index,
  which is likely the newer save); shards without an index are refused, as transformers refuses them;
- ranks pointed at different checkpoints of the same shapes: every rank refuses (they loaded a mixture);
- a checkpoint path missing on one rank, an unwritable save path, a write failing on the writing rank: every rank
  raises (the peer got "Connection reset by peer" or waited the whole timeout);
- save_pretrained's dtype: floating dtypes and their names only (int8 wrote weights transformers refuses, a name
  failed with AttributeError);
- a re-save over a good export that fails midway, or is killed (kill -9): the old export still loads (it was
  deleted first); also through a symlinked export directory, and with two renames where the file system has no
  atomic exchange;
- device='meta' (a meta-tensor error) or not a device, a truncated safetensors file or a config.json that is not
  JSON (errors naming no file).

Mutations seen failing: see each test's docstring.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from deltacp import load_pretrained, save_pretrained
from deltacp.distributed.launch import run_distributed
from deltacp.checkpoint_io.hf_format import read_index
from deltacp.checkpoint_io.pretrained import load_device, resolve_class
from deltacp.checkpoint_io import save as save_module
from helpers import cp_mesh, full_tensors, tiny_config

pytestmark = pytest.mark.fast


def _model(seed: int) -> transformers.Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForCausalLM(tiny_config())


def _params(path) -> dict[str, torch.Tensor]:
    return dict(transformers.Qwen3_5ForCausalLM.from_pretrained(path).state_dict())


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _expect(error, pattern, fn):
    with pytest.raises(error, match=pattern):
        fn()


def _gathered(model) -> dict[str, torch.Tensor]:
    return full_tensors(model.state_dict())


def _worker(rank, world, root):
    root = Path(root)
    mesh = cp_mesh()
    good, other = root / "sharded", root / "other"  # (sharded/ also holds shards of an older save)
    # the index's shards, not the stale ones beside them
    model = load_pretrained(good, mesh, linear_attention_cp_mode="p2p", dtype=torch.float32)
    expected = torch.load(root / "expected.pt")
    got = _gathered(model)
    assert all(torch.equal(got[k], expected[k]) for k in expected), "the stale shards were read"
    # ranks given different checkpoints of the same shapes
    _expect(ValueError, r"load_pretrained: ranks disagree on checkpoint",
            lambda: load_pretrained(good if rank == 0 else other, mesh, linear_attention_cp_mode="p2p"))
    # a path missing on rank 1 only
    if rank == 1:
        _expect(FileNotFoundError, r"not a local checkpoint directory",
                lambda: load_pretrained(root / "missing", mesh, linear_attention_cp_mode="p2p"))
    else:
        _expect(RuntimeError, r"load_pretrained: the checks failed on rank\(s\) \[1\] \(rank 1: FileNotFoundError",
                lambda: load_pretrained(good, mesh, linear_attention_cp_mode="p2p"))
    _expect(ValueError, r"load_pretrained: device='meta' holds no weights",
            lambda: load_pretrained(good, mesh, linear_attention_cp_mode="p2p", device="meta"))

    # save: an unwritable path on the writing rank (rank 0), a bad dtype on one rank, a write failing midway
    (root / "a_file").touch()
    bad = root / "a_file" / "export" if rank == 0 else root / f"fine_{rank}"
    _expect((NotADirectoryError, FileExistsError, RuntimeError), r"a_file|rank\(s\) \[0\]",
            lambda: save_pretrained(model, bad))
    _expect((ValueError, RuntimeError), r"save_pretrained: dtype=torch\.int8 is not supported; expected one of "
                                        r"\['float32', 'bfloat16', 'float16', 'float64'\]|rank\(s\) \[1\]",
            lambda: save_pretrained(model, root / "export", dtype=torch.float32 if rank == 0 else torch.int8))
    assert rank != 0 or not list(root.glob(".export.staging-*")), "the failed save left its staging directory"
    save_pretrained(model, root / "export", dtype="bfloat16")  # a dtype's name
    first = _params(root / "export") if rank == 0 else None
    if rank == 0:
        assert first["lm_head.weight"].dtype == torch.bfloat16
        (root / "export" / "tokenizer.json").write_text("{}")  # kept by a re-save, as transformers keeps it
    real_write, calls = save_module._Writer.write, []

    def failing_write(self, data):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")  # (kept by _Writer._try like a real write's)
        real_write(self, data)

    save_module._Writer.write = lambda self, data: self._try(failing_write, self, data)
    try:
        _expect((OSError, RuntimeError), r"No space left on device",
                lambda: save_pretrained(model, root / "export", dtype=torch.float32, block_bytes=256))
    finally:
        save_module._Writer.write = real_write
    if rank == 0:
        assert _same(_params(root / "export"), first), "the old export changed"
        assert not list(root.glob(".export.staging-*")), "a staging directory was left"
    torch.distributed.barrier()
    save_pretrained(model, root / "export", dtype=torch.float32, max_shard_size="20KB")  # replaces it
    if rank == 0:
        again = _params(root / "export")
        assert again["lm_head.weight"].dtype == torch.float32 and _same(
            {k: v.to(torch.bfloat16) for k, v in again.items()}, first)
        assert (root / "export" / "tokenizer.json").read_text() == "{}"
        assert not (root / "export" / "model.safetensors").exists()  # now shards with their index


def test_checkpoint_faults_on_two_ranks(tmp_path):
    """Mutations seen failing: the RowReader's metadata from every file (HuggingFaceStorageReader's: the stale
    weights load); the digest left out of the agreed values (the ranks load a mixture); OSError not kept by
    load_pretrained's checks (rank 0 waits in the exchange, rank 1 raises alone: a gloo connection error); the
    write error not kept by the writer (the senders wait, then a gloo error); the staging swap replaced by writing
    into the export (the old export is gone after the failed re-save); the staging directory kept when another
    rank's check fails (a stray directory)."""
    good = _model(0)
    good.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    torch.save({k: v.clone() for k, v in good.state_dict().items()}, tmp_path / "expected.pt")
    _model(1).save_pretrained(tmp_path / "stale", max_shard_size="60KB")  # an older save's shards, other names
    for shard in (tmp_path / "stale").glob("model-*.safetensors"):
        assert not (tmp_path / "sharded" / shard.name).exists()
        shard.rename(tmp_path / "sharded" / shard.name)
    _model(2).save_pretrained(tmp_path / "other", max_shard_size="20KB")
    run_distributed(_worker, 2, str(tmp_path), timeout_s=300, collective_timeout_s=60)


def test_a_stale_single_file_beside_an_index_is_refused(tmp_path):
    """An index and its shards beside a model.safetensors the index does not name: transformers 5.25 reads the
    single file (checked here), the index is likely the newer save: refused, naming both. Mutation seen failing:
    the check removed (the shards load, unlike transformers)."""
    _model(0).save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    stale = _model(1)
    save_file({k: v.contiguous() for k, v in stale.state_dict().items()}, tmp_path / "ckpt" / "model.safetensors",
              metadata={"format": "pt"})
    assert _same(_params(tmp_path / "ckpt"), dict(stale.state_dict()))  # transformers' choice
    with pytest.raises(ValueError, match=r"ckpt: both model\.safetensors and model\.safetensors\.index\.json "
                                         r"\(naming 28 other file\(s\), e\.g\. model-00001-of-00028\.safetensors\)"):
        read_index(tmp_path / "ckpt")


def test_each_tensor_is_read_from_the_file_the_weight_map_names(tmp_path):
    """A tensor that two named files hold (a shard rewritten by hand, say) is read from the one the weight_map gives;
    a file the index does not name is not even opened. Mutations seen failing: every tensor of every named file kept
    (the later file's copy won); every *.safetensors of the directory opened (the unnamed junk file refused)."""
    ckpt = tmp_path / "ckpt"
    _model(0).save_pretrained(ckpt, max_shard_size="20KB")
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    first, last = sorted(set(weight_map.values()))[0], sorted(set(weight_map.values()))[-1]
    key = next(k for k, f in weight_map.items() if f == first)
    extra = {k: v.contiguous() for k, v in _model(1).state_dict().items() if weight_map.get(k) == last or k == key}
    save_file(extra, ckpt / last, metadata={"format": "pt"})  # the last file also holds a stale copy of `key`
    (ckpt / "consolidated.safetensors").write_bytes(b"junk")
    assert read_index(ckpt)[key].file == str(ckpt / first)


def test_shards_without_an_index_and_a_truncated_file_are_named(tmp_path):
    """Mutations seen failing: the header's length check removed (a truncated file: safetensors' error or a short
    read, naming no file); config.json read without naming it (json's message alone)."""
    _model(0).save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    (tmp_path / "ckpt" / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"safetensors file\(s\) \(model-00001-of-.*but neither "
                                                r"model\.safetensors nor model\.safetensors\.index\.json"):
        read_index(tmp_path / "ckpt")
    _model(0).save_pretrained(tmp_path / "one")
    weights = tmp_path / "one" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{weights}: truncated: its tensors end at byte \d+, the file has \d+"):
        read_index(tmp_path / "one")
    weights.write_bytes(b"\x05")
    with pytest.raises(ValueError, match=rf"{weights}: not a safetensors file \(1 bytes"):
        read_index(tmp_path / "one")
    (tmp_path / "one" / "config.json").write_text("{")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'one' / 'config.json'}: not JSON"):
        resolve_class(tmp_path / "one", None)


def test_a_device_that_is_not_one_is_named():
    """device='gpu' (torch's own RuntimeError named no setting). Mutation seen failing: torch.device unwrapped."""
    with pytest.raises(ValueError, match=r"load_pretrained: device='gpu' is not a device; expected None"):
        load_device("gpu", None)


def test_a_bad_max_shard_size_is_named_before_anything_is_written(tmp_path):
    """max_shard_size=None (an AttributeError from transformers), 'abc' (a ValueError naming `size`), 0. Mutation
    seen failing: transformers' conversion unwrapped."""
    for bad in (None, "abc", 0):
        with pytest.raises(ValueError, match=rf"save_pretrained: max_shard_size={bad!r} is not supported; expected a "
                                             rf"positive number of bytes or a size string such as '5GB'"):
            save_pretrained(_model(0), tmp_path / "export", max_shard_size=bad)
    assert not list(tmp_path.iterdir())


KILLED_SAVE = textwrap.dedent("""
    import os, sys, time, torch, transformers
    sys.path.insert(0, {tests!r})
    from helpers import tiny_config
    from deltacp import save_pretrained
    from deltacp.checkpoint_io import save as save_module
    real = save_module._Writer.write
    def slow(self, data):
        real(self, data)
        print("writing", flush=True)
        time.sleep(30)  # killed here, the new export half written
    save_module._Writer.write = slow
    torch.manual_seed(5)
    save_pretrained(transformers.Qwen3_5ForCausalLM(tiny_config()), {out!r})
""")


def test_a_killed_resave_leaves_the_old_export_loadable(tmp_path):
    """kill -9 of the saving process while it writes over a good export: the old export loads, unchanged.
    Mutation seen failing: the staging swap replaced by writing into the export."""
    out = tmp_path / "export"
    save_pretrained(_model(0), out)
    before = _params(out)
    code = KILLED_SAVE.format(tests=str(Path(__file__).resolve().parents[1]), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert _same(_params(out), before)
    save_pretrained(_model(1), out)  # the next save clears the killed one's staging directory
    assert not list(tmp_path.glob(".export.staging-*"))
    assert not _same(_params(out), before)


def test_a_resave_through_a_symlinked_export_replaces_its_target(tmp_path):
    """An export directory reached through a symlink (on another disk, say): the re-save replaces the target's
    contents and the link stays a link, nothing left beside either. Mutation seen failing: staging beside the link
    (the link was swapped for a directory, the old export left behind a stray staging link)."""
    (tmp_path / "disk").mkdir()
    save_pretrained(_model(0), tmp_path / "disk" / "export")
    (tmp_path / "export").symlink_to(tmp_path / "disk" / "export", target_is_directory=True)
    save_pretrained(_model(1), tmp_path / "export")
    assert (tmp_path / "export").is_symlink()
    assert _same(_params(tmp_path / "disk" / "export"), dict(_model(1).state_dict()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "export"]
    assert [p.name for p in (tmp_path / "disk").iterdir()] == ["export"]


def test_without_an_atomic_exchange_a_save_killed_between_its_renames_is_undone(tmp_path, monkeypatch):
    """A file system without renameat2's exchange (NFS, say): two renames. A save killed between them (the old
    export moved aside, the new one not yet in place) is undone by the next save, even one that fails; a re-save
    keeps the tokenizer and leaves nothing beside the export. Mutation seen failing: the moved-aside export not put
    back (nothing at the path)."""
    monkeypatch.setattr(save_module, "_exchange", lambda a, b: False)
    out = tmp_path / "export"
    save_pretrained(_model(0), out)
    (out / "tokenizer.json").write_text("{}")
    save_pretrained(_model(1), out)
    assert (out / "tokenizer.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    before = _params(out)
    (tmp_path / ".export.old-x1").mkdir()
    out.rename(tmp_path / ".export.old-x1" / "export")  # as a kill between the two renames leaves it
    monkeypatch.setattr(save_module._Writer, "open", lambda self, name: self._try(_full_disk))
    with pytest.raises(OSError, match="No space left on device"):
        save_pretrained(_model(2), out)
    assert _same(_params(out), before) and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def _full_disk():
    raise OSError(28, "No space left on device")


def test_without_an_atomic_exchange_a_failed_second_rename_puts_the_old_export_back(tmp_path, monkeypatch):
    """The two renames (no renameat2 exchange): when the second one (the new export into place) fails, the old
    export moved aside is renamed back, whole, and the error reaches the caller; nothing but the export is left beside
    it (until 2026-12-06 an empty `.export.old-*` stayed). Mutation seen failing: the put-back removed (nothing at
    the path)."""
    monkeypatch.setattr(save_module, "_exchange", lambda a, b: False)
    out = tmp_path / "export"
    save_pretrained(_model(0), out)
    (out / "tokenizer.json").write_text("{}")
    before = _params(out)
    rename = os.rename

    def second_fails(src, dst):
        if Path(dst) == out and ".staging-" in str(src):
            raise OSError(5, "Input/output error")
        return rename(src, dst)

    monkeypatch.setattr(save_module.os, "rename", second_fails)
    with pytest.raises(OSError, match="Input/output error"):
        save_pretrained(_model(1), out)
    monkeypatch.setattr(save_module.os, "rename", rename)
    assert _same(_params(out), before) and (out / "tokenizer.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # (no staging, no empty `.export.old-*`)
