"""transformers' Trainer and TRL's SFTTrainer under deltacp CP (gloo CPU ranks, float32) against the same trainer on
one process: per-step loss and grad norm as the trainer logs them, eval_loss, and the saved directory.

Cases (integ_cases.py: a tiny Qwen3.5, byte tokenizer, STEPS=3 optimizer steps of gradient accumulation 2):
Trainer with padded rows (DataCollatorForLanguageModeling) and packed rows (DataCollatorWithFlattening), SFTTrainer
with padding_free packed rows and padded rows (activation checkpointing on: SFTConfig's default). CP2 (2 ranks) runs
one case of each trainer (SFTTrainer's under deltacp's default, selective checkpointing), and the SFTTrainer case
again with activation_checkpointing_kwargs selective=False (full); dp2 x cp2 (4 ranks) runs one case of each trainer
(the Trainer's padded rows, the SFTTrainer's packed rows, which it saves) and the Trainer's packed rows with
replicated parameters (fsdp=False); the SFTTrainer's padded rows run at CP2 (GLM-5.3-Flash). The reference is the same trainer on one process at dp x the per-device batch (the same global batch per
step) with padded rows: on the CPU transformers refuses packed rows for Qwen3.5 on one device (its conv cannot keep
documents apart without the causal_conv1d kernel), and padded rows of the same documents have the same targets,
the same count and, documents being independent, the same loss and gradients.
Other families at CP2 against one process: OLMo-Hybrid, Nemotron-H and Qwen4-Exp (full_attention_cp="all_gather")
through SFTTrainer (packed rows), Bamba (packed rows) and Qwen4-Exp (padded rows) through the Trainer.

A 2-rank spawn of its own (in the fast tier) checks how collated batches are cut, what the CP trainer refuses and the
fault trial's cases.

The SFTTrainer's token metrics (entropy, mean_token_accuracy, num_tokens) are compared per step, and in evaluation
at CP2 (at dp 2 the one-process reference evaluates each dp group's rows as its own batch, where TRL averages token
metrics over the step's rows of every process).

Bounds (float32; observed: loss <= 1.8e-7, grad norm <= 2.2e-7, eval_loss 0, weights 7.6e-7, token metrics 1.0e-7,
about 10x below them).
Mutations seen failing: loaders left sharded by world rank (CP ranks of a group get other rows: deltacp's input check
raises at the first step); the target count not all-reduced (each rank's loss over its own count: loss and grad
norm x2 at CP2, x4 at dp2 x cp2); the mean taken per dp group (count and loss over the CP group only: grad norm x2,
loss 1e-3 off at dp2 x cp2); the token metrics' sums not reduced over the ranks (each rank's own: entropy,
accuracy and num_tokens off at CP2); Qwen4-Exp's indexed attention keeping the lowest-scoring blocks (a
descending=False sort: grad norm 2.8e-3 (SFTTrainer) and 1.8e-2 (Trainer) off).
"""

from __future__ import annotations

import json
import os

import pytest

from deltacp.distributed.launch import run_distributed
from deltacp.integrations import checkpointing_arguments
import integ_cases
from helpers import started_in_process

LOSS_REL, GNORM_REL, EVAL_REL, WEIGHT_REL, METRIC_REL = 2e-6, 2e-6, 2e-6, 1e-5, 2e-6
CP2_CASES = ("trainer-padded", "sft-packed")
DP2_CASES = ("trainer-padded", "sft-packed")  # and the Trainer's packed rows, replicated (test below)
SAVED = "sft-packed"  # saved at dp2 x cp2; its reference saves too


def _reference_main(out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    results = {}
    for dp in (1, 2):
        for kind in ("trainer", "sft"):
            results[f"{kind}/dp{dp}"] = integ_cases.run_case(f"{kind}-padded", os.path.join(out_dir, f"ref-{kind}-dp{dp}"),
                                                             dp=dp, save=dp == 2 and SAVED.startswith(kind))
    # OLMo-Hybrid (another family through the same drop-ins): SFTTrainer, one process
    results["sft/dp1-olmo"] = integ_cases.run_case("sft-padded", os.path.join(out_dir, "ref-sft-olmo"), dp=1,
                                                   family="olmo_hybrid")
    results["trainer/dp1-bamba"] = integ_cases.run_case("trainer-padded", os.path.join(out_dir, "ref-trainer-bamba"),
                                                        dp=1, family="bamba")
    results["sft/dp1-nemotron"] = integ_cases.run_case("sft-padded", os.path.join(out_dir, "ref-sft-nemotron"), dp=1,
                                                       family="nemotron_h")
    results["sft/dp1-qwen4"] = integ_cases.run_case("sft-padded", os.path.join(out_dir, "ref-sft-qwen4"), dp=1,
                                                    family="qwen4_exp")
    results["trainer/dp1-qwen4"] = integ_cases.run_case("trainer-padded", os.path.join(out_dir, "ref-trainer-qwen4"),
                                                        dp=1, family="qwen4_exp")
    results["sft/dp1-glm5"] = integ_cases.run_case("sft-padded", os.path.join(out_dir, "ref-sft-glm5"), dp=1,
                                                   family="glm5_next")
    results["trainer/dp1-glm5"] = integ_cases.run_case("trainer-padded", os.path.join(out_dir, "ref-trainer-glm5"),
                                                       dp=1, family="glm5_next")
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(results, f)


def _check_batches_and_refusals(out_dir: str) -> None:
    """At CP2: how collated batches are cut (padding to a multiple of cp, the target count) and what is refused."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Trainer

    from deltacp.integrations import CPTrainerMixin, shard_collated_batch

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    ids = torch.arange(1, 15).reshape(2, 7)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    labels = ids.masked_fill(mask == 0, -100)
    cut = shard_collated_batch(dict(input_ids=ids, attention_mask=mask, labels=labels), mesh, pad_token_id=0)
    assert cut["input_ids"].shape == (2, 4) and cut["attention_mask"].shape == (2, 4)
    count = (cut["target_ids"] != -100).sum()
    dist.all_reduce(count)
    assert count.item() == (labels[:, 1:] != -100).sum().item() == 10
    packed = dict(input_ids=ids[:1], labels=ids[:1].clone(), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    for batch, match in ((packed, "label at a document start"),
                         (dict(packed, labels=torch.where(packed["position_ids"] == 0, -100, ids[:1]),
                               cu_seq_lens_q=torch.tensor([0, 3, 7]), cu_seq_lens_k=torch.tensor([0, 7])),
                          "cu_seq_lens_k must equal cu_seq_lens_q"),
                         (dict(input_ids=ids, labels=labels.flip(1), attention_mask=mask.flip(1)), "left-padded rows"),
                         (dict(input_ids=ids, labels=ids, attention_mask=mask), "label at a padded position"),
                         (dict(input_ids=ids, labels=labels, token_type_ids=ids), "token_type_ids")):
        with pytest.raises(ValueError, match=match):
            shard_collated_batch(batch, mesh)

    class OwnLoss(Trainer):
        def compute_loss(self, *args, **kwargs):
            raise AssertionError("never called")

    class Refused(CPTrainerMixin, OwnLoss):
        pass

    def refused(**kwargs):
        with pytest.raises(ValueError) as info:
            integ_cases.build("trainer-padded", os.path.join(out_dir, "refused"), cp_size=2, dp=1, **kwargs)
        return str(info.value)

    message = refused(cls=Refused, args_extra=dict(label_smoothing_factor=0.1, save_strategy="steps",
                                                     include_num_input_tokens_seen="all"),
                      compute_metrics=lambda prediction: {})
    for part in ("trainer class OwnLoss", "label_smoothing_factor", "save_only_model=True",
                 "include_num_input_tokens_seen", "compute_metrics"):
        assert part in message, (part, message)
    assert "fsdp=False" in refused(args_extra=dict(bf16=True), fsdp=False)
    message = refused(args_extra=checkpointing_arguments(policy="partial", offload=True))
    assert "policy='partial' is not an activation checkpointing policy" in message and "offload" in message, message
    message = refused(args_extra=checkpointing_arguments(bogus_key=1))
    assert "activation_checkpointing_kwargs ['bogus_key'] (deltacp's checkpointing takes every_n_layers" in message
    message = refused(args_extra=checkpointing_arguments(policy="full", selective=True))
    assert "policy='full' and selective=True disagree" in message, message
    trainer = integ_cases.build("trainer-padded", os.path.join(out_dir, "refusals"), cp_size=2, dp=1)
    with pytest.raises(NotImplementedError, match="resuming"):
        trainer.train(resume_from_checkpoint=out_dir)
    with pytest.raises(NotImplementedError, match="predict"):
        trainer.predict(trainer.eval_dataset)


def _check_fault_cases(out_dir: str) -> None:
    """At CP2: what a user's script can get wrong is refused on every rank at once, and a short batch under p2p
    is padded instead of ending the run (the fault trial of 2026-12-04)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    where = os.path.join(out_dir, "faults")
    # a CP keyword typo: refused before the trainer prepares any dataset (this one would fail its preparation)
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"deltacp: linear_attention_cp_mode='p2pp' is not supported; expected one of"):
        integ_cases.build("sft-packed", where, cp_size=2, dp=1, linear_attention_cp_mode="p2pp",
                          train_dataset=Dataset.from_dict({"no_text_column": [1, 2]}))
    with pytest.raises(ValueError, match=r"deltacp: train_dataset is empty \(0 rows\)"):
        integ_cases.build("sft-packed", where, cp_size=2, dp=1, train_lines=[])
    # ranks whose datasets differ in length would plan different step counts: every rank refuses at train()
    lines = integ_cases.texts(8, 3) + (["one more row"] if rank == 1 else [])
    trainer = integ_cases.build("sft-packed", where, cp_size=2, dp=1, train_lines=lines,
                                args_extra=dict(max_steps=-1, num_train_epochs=1))
    with pytest.raises(ValueError, match=r"the training plan: ranks disagree on train_dataset_rows \(rank 0: 8, "
                                         r"rank 1: 9\)"):
        trainer.train()
    # p2p + balanced, one row per step, rows far shorter than 2 x cp x conv halo (12 tokens): padded with an
    # ignored padding document up to it, so every step runs (it raised at the first short row before)
    short = ["a", "bc", "gated delta", "d", "context parallel rank", "e"]
    trainer = integ_cases.build("sft-packed", where, cp_size=2, dp=1, train_lines=short,
                                linear_attention_cp_mode="p2p", sequence_layout="balanced",
                                args_extra=dict(max_steps=len(short), per_device_train_batch_size=1,
                                                gradient_accumulation_steps=1))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == len(short) and all(loss == loss for loss in losses), losses
    # GRPO's padded rows (padding_free=False) under that model: left-padded rows of 8 columns (a multiple of 2 x cp,
    # short of its 12-token shortest row) are padded up to 12 by completion_rows, so the cut appends nothing to
    # left-padded rows; padded to the multiple alone, the cut refuses them, naming why
    import torch

    from deltacp.integrations import shard_collated_batch
    from deltacp.integrations.batch import completion_rows
    from deltacp.batching import batch_row_cut

    model, cut = trainer.model, batch_row_cut(None, trainer.model)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]])
    ids = torch.arange(1, 17).reshape(2, 8) * mask
    rows, _ = completion_rows(ids, mask, 3, padding_free=False, row_cut=cut, cp=2)  # what CPGRPOTrainer calls
    assert cut.min_row_length(2) == 12 and rows["input_ids"].shape == (2, 12)
    assert shard_collated_batch(rows, trainer.cp_mesh, model=model)["input_ids"].shape == (2, 6)
    rows, _ = completion_rows(ids, mask, 3, padding_free=False, cp=4)  # a multiple of 2 x cp only
    with pytest.raises(ValueError, match=r"left-padded rows of length 8 need 12 columns \(the shortest row"):
        shard_collated_batch(rows, trainer.cp_mesh, model=model)


def _checks_worker(rank: int, world: int, out_dir: str) -> None:
    _check_batches_and_refusals(out_dir)
    _check_fault_cases(out_dir)


@pytest.mark.fast
def test_batches_refusals_and_fault_cases_cp2(tmp_path):
    """At CP2: how collated batches are cut, what the CP trainer refuses, the fault trial's cases."""
    run_distributed(_checks_worker, 2, str(tmp_path), timeout_s=600)


def _cp_worker(rank: int, world: int, out_dir: str, runs: list) -> None:
    dp = world // 2
    results = {}
    for case, label, kwargs in runs:
        run_dir = os.path.join(out_dir, f"cp-{label}")
        results[label] = integ_cases.run_case(case, run_dir, cp_size=2, dp=dp, **kwargs)
    if rank == 0:
        with open(os.path.join(out_dir, f"cp{world}.json"), "w") as f:
            json.dump(results, f)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _compare(label: str, got: dict, ref: dict) -> list[str]:
    failures = []
    assert len(got["steps"]) == len(ref["steps"]) == integ_cases.STEPS, (label, got["steps"], ref["steps"])
    loss = max(_rel(g[0], r[0]) for g, r in zip(got["steps"], ref["steps"]))
    gnorm = max(_rel(g[1], r[1]) for g, r in zip(got["steps"], ref["steps"]))
    ev = _rel(got["eval_loss"], ref["eval_loss"])
    print(f"{label}: {len(got['steps'])} steps, max loss rel {loss:.1e}, max grad-norm rel {gnorm:.1e}, "
          f"eval_loss rel {ev:.1e}")
    for name, value, bound in (("loss", loss, LOSS_REL), ("grad norm", gnorm, GNORM_REL), ("eval_loss", ev, EVAL_REL)):
        if not value <= bound:
            failures.append(f"{label}: {name} rel diff {value:.2e} > {bound:.0e} (got {got}, reference {ref})")
    # TRL's token metrics (SFTTrainer only): the same keys on every step and in evaluation, the same values
    pairs = [(f"step {i + 1} {k}", g[k], r[k]) for i, (g, r) in enumerate(zip(got["metrics"], ref["metrics"]))
             for k in r]
    if label.endswith("/cp2"):
        # at dp 2 the reference evaluates 2-row batches on one process, where its eval_loss is each dp group's; TRL
        # averages token metrics per evaluation step, here over both dp groups' rows (TRL at dp 2 does the same)
        pairs += [(f"eval {k}", got["eval_metrics"][k], v) for k, v in ref["eval_metrics"].items()]
    assert [set(m) for m in got["metrics"]] == [set(m) for m in ref["metrics"]], (label, got["metrics"])
    assert set(got["eval_metrics"]) == set(ref["eval_metrics"]), (label, got["eval_metrics"])
    if label.startswith("sft"):
        assert set(ref["metrics"][0]) == set(integ_cases.TOKEN_METRICS), ref["metrics"]
    worst = max((_rel(g, r) for _, g, r in pairs), default=0.0)
    if pairs:
        print(f"{label}: token metrics (entropy, mean_token_accuracy, num_tokens) max rel {worst:.1e}")
    failures += [f"{label}: {name} {g!r} vs {r!r}" for name, g, r in pairs if not _rel(g, r) <= METRIC_REL]
    return failures


def _compare_saved(got_dir: str, ref_dir: str) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(got_dir, name)), f"{name} missing from the saved directory"
    got, ref = (AutoModelForCausalLM.from_pretrained(d, local_files_only=True) for d in (got_dir, ref_dir))
    AutoTokenizer.from_pretrained(got_dir, local_files_only=True)
    assert type(got) is type(ref)
    got_sd, ref_sd = got.state_dict(), ref.state_dict()
    assert got_sd.keys() == ref_sd.keys()
    diff = torch.cat([(got_sd[k] - ref_sd[k]).flatten().double() for k in sorted(ref_sd)]).norm()
    rel = (diff / torch.cat([ref_sd[k].flatten().double() for k in sorted(ref_sd)]).norm()).item()
    print(f"saved model: weights rel L2 {rel:.1e} vs the reference's")
    return [] if rel <= WEIGHT_REL else [f"saved weights rel L2 {rel:.2e} > {WEIGHT_REL:.0e}"]


def test_trainer_and_sft_trainer_match_one_process(tmp_path):
    """CP2 and dp2 x cp2 against one process: loss and grad norm per step, eval_loss, the saved weights (Qwen3.5;
    OLMo-Hybrid, Nemotron-H (Mamba2, MoE), Qwen4-Exp (indexed attention, PLE) and GLM-5.3-Flash (padded rows)
    through SFTTrainer, Bamba (Mamba2), Qwen4-Exp and GLM-5.3-Flash (padded rows) through the Trainer at CP2)."""
    import time
    out, t0 = str(tmp_path), time.time()
    cp2_runs = [(c, f"{c}/cp2", {}) for c in CP2_CASES]
    cp2_runs.append(("sft-packed", "sft-packed/cp2-full",
                     dict(args_extra=checkpointing_arguments(selective=False))))
    cp2_runs.append(("sft-packed", "sft-packed/cp2-olmo", dict(family="olmo_hybrid")))
    cp2_runs.append(("trainer-packed", "trainer-packed/cp2-bamba", dict(family="bamba")))  # Mamba2, eager
    cp2_runs.append(("sft-packed", "sft-packed/cp2-nemotron", dict(family="nemotron_h")))  # Mamba2 + MoE blocks
    cp2_runs.append(("sft-packed", "sft-packed/cp2-qwen4", dict(family="qwen4_exp", full_attention_cp="all_gather")))
    cp2_runs.append(("trainer-padded", "trainer-padded/cp2-qwen4", dict(family="qwen4_exp",
                                                                        full_attention_cp="all_gather")))
    # GLM-5.3-Flash's conditional class with text (padded rows: transformers' GLM reads no packed documents)
    cp2_runs.append(("sft-padded", "sft-padded/cp2-glm5", dict(family="glm5_next", full_attention_cp="all_gather")))
    cp2_runs.append(("trainer-padded", "trainer-padded/cp2-glm5", dict(family="glm5_next",
                                                                       full_attention_cp="all_gather")))
    with started_in_process(_reference_main, out):  # the one-process references beside the CP2 ranks
        run_distributed(_cp_worker, 2, out, cp2_runs, timeout_s=600)
        t1 = time.time()
    t2 = time.time()
    dp2_runs = [(c, f"{c}/dp2xcp2", dict(save=c == SAVED)) for c in DP2_CASES]
    dp2_runs.append(("trainer-packed", "trainer-packed/dp2xcp2-replicated", dict(fsdp=False)))
    run_distributed(_cp_worker, 4, out, dp2_runs, timeout_s=600)
    print(f"times: cp2 {t1 - t0:.0f} s, the references {t2 - t0:.0f} s, dp2xcp2 {time.time() - t2:.0f} s")

    with open(os.path.join(out, "reference.json")) as f:
        ref = json.load(f)
    runs = {}
    for world in (2, 4):
        with open(os.path.join(out, f"cp{world}.json")) as f:
            runs.update(json.load(f))
    failures = []
    for label, got in runs.items():
        case, layout = label.split("/")
        family = next((f"-{f}" for f in ("olmo", "bamba", "nemotron", "qwen4", "glm5") if layout.endswith(f"-{f}")),
                      "")
        failures += _compare(label, got, ref[f"{case.split('-')[0]}/dp{1 if layout.startswith('cp2') else 2}{family}"])
        sft = case.startswith("sft")  # SFTConfig checkpoints activations by default: deltacp's, not the trainer's
        assert got["checkpointed"] and set(got["checkpointed"]) == {sft} and not got["trainer_checkpointing"], (
            label, got["checkpointed"])
    saved = runs[f"{SAVED}/dp2xcp2"]
    failures += _compare_saved(saved["saved"], ref[f"{SAVED.split('-')[0]}/dp2"]["saved"])
    assert os.path.isfile(os.path.join(saved["checkpoint"], "model.safetensors")), "no weights in the checkpoint"
    assert not failures, "\n".join(failures)
