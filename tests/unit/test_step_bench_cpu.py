"""bench/step.py (run on the H200 by `scripts/gpu_checks.sh step`, `step_9b`, `step_128k`) reports what it measured: its table
and target lines from rows written here (no GPU): the speed-ups over the liger and flce stacks, the targets met or
not (the selective row also against the liger stack's peak memory), and a step-0 loss that disagrees is a failure."""

import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import step  # noqa: E402


def _row(stack, ms, peak, loss0=12.5, tokens=65536):
    return dict(stack=stack, tokens=tokens, median_ms=ms, peak_gib=peak, loss0=loss0, tokens_per_s=tokens / ms * 1e3)


def test_report_and_targets(capsys):
    args = Namespace(size="2B", layers=None, lengths=[65536], repeat=2, warmup=1, profile=False, loss_tol=1e-3)
    names = ["liger", "flce", "deltacp/full", "deltacp/selective"]
    rows = [_row("liger", 3000.0, 28.0), _row("flce", 3400.0, 29.0), _row("deltacp/full", 2000.0, 25.0),
            _row("deltacp/selective", 2100.0, 28.5, loss0=12.5001)]
    assert step.report(args, rows, names, "a GPU") == []
    out = capsys.readouterr().out
    assert "deltacp/full" in out and " 1.500 " in out and " 1.700 " in out  # 3000 / 2000, 3400 / 2000
    assert ("targets at 2B 65536: deltacp over the liger stack: full 1.500x (target 1.35x: met); selective 1.429x "
            "(target 1.45x: NOT met), peak 28.50 vs liger 28.00 GiB (NOT met)") in out, out

    rows[3] = _row("deltacp/selective", 2000.0, 27.0, loss0=12.6)
    failed = step.report(args, rows, names, "a GPU")
    assert len(failed) == 1 and "step-0 losses differ at 65536: deltacp/selective 12.6 vs liger 12.5" in failed[0]
    assert "selective 1.500x (target 1.45x: met), peak 27.00 vs liger 28.00 GiB (met)" in capsys.readouterr().out

    nine = Namespace(**{**vars(args), "size": "9B", "layers": 8})
    assert step.target_lines(nine, {(65536, r["stack"]): r for r in rows}) == [
        "targets at 9B (8 layers) 65536: deltacp over the liger stack: full 1.500x (target 1.25x: met)"]
    args.lengths = [16384]
    assert step.target_lines(args, {}) == []  # no target at 16K


def test_liger_stack_restores_what_the_patch_swaps_in_transformers(monkeypatch):
    """The liger stack patches its own model only: the module-level classes liger's patch also swaps are put back
    (a stand-in patch here: liger-kernel needs a GPU); its loss is the model's own next-token mean."""
    import types

    import torch
    import torch.nn.functional as F
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from transformers import Qwen3_5ForCausalLM

    from helpers import tiny_config

    calls = []

    def apply_liger_kernel_to_qwen3_5(model=None, **kwargs):  # swaps module classes as the real one does
        calls.append((model, kwargs))
        modeling.Qwen3_5RMSNorm, modeling.Qwen3_5MLP = object, object

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_qwen3_5 = apply_liger_kernel_to_qwen3_5
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    norm, mlp = modeling.Qwen3_5RMSNorm, modeling.Qwen3_5MLP
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_config()).train()
    ids = torch.randint(0, 256, (1, 32))
    loss_fn, _ = step.liger_stack(model, ids)
    assert calls == [(model, {})] and modeling.Qwen3_5RMSNorm is norm and modeling.Qwen3_5MLP is mlp
    assert model.is_gradient_checkpointing
    with torch.no_grad():
        expected = F.cross_entropy(model(ids, use_cache=False).logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(loss_fn().detach(), expected)
