"""CPGRPOTrainer (TRL's GRPOTrainer under deltacp CP, gloo CPU ranks) against TRL's GRPOTrainer without CP: every
logged number of every step (loss, grad norm, kl, clip ratios, entropy, rewards, completion lengths, tokens), the
evaluation's metrics and the saved weights.

Cases (grpo_cases.py: a tiny Qwen3.5, STEPS=3 optimizer steps, the same completions in both trainers from a
test-only `rollout_func`): at CP2 against TRL on one process, "grpo" (beta 0.1, token-level importance sampling,
gradient accumulation 2 with steps_per_generation 4, so generations are reused across optimizer steps and ratios
clip; top_entropy_quantile 0.8; p2p, contiguous, packed rows; evaluation) and "bnpo" (sequence-level importance
sampling, steps_per_generation 2, an entropy bonus; ulysses, balanced, padded rows, replicated parameters); at dp2 x cp2 against TRL at dp 2 (two processes: TRL's result depends on its process count,
as each process shuffles and splits its own generation batch; a dp group stands for one process), "dr_grpo" (beta
0.05, sequence-level, num_iterations 2, mask_truncated_completions, the reference model mixed with the policy every 2
steps; all_gather, contiguous, packed) and "dapo" (beta 0.1, token-level,
steps_per_generation 4; p2p, balanced, padded rows; float64, the saved weights compared). "grpo-falcon_h1" runs
"grpo" on a tiny Falcon-H1 (balanced) and "bnpo-qwen4_exp" "bnpo" on a tiny Qwen4-Exp (GDN, indexed attention with
full_attention_cp="all_gather", its budget 6 so that rows of up to 12 tokens select sparsely, a PLE layer, eager
experts), both at CP2 against one process; "bnpo-glm5_next" the same on a tiny GLM-5.3-Flash
(`Glm5NextForConditionalGeneration` loaded by the class its saved config names, as TRL's loader does: KDA, MLA with
the pooled indexer and a "shared" layer, hyper-connections, eager experts and attention; the reference's float32
eager softmax would turn a float64 padded query into NaN, `float64_upcasts` keeps it float64).

The same 2-rank spawn generates for real (transformers' generate on the model outside CP, parameters unsharded):
greedy completions of two rounds, the second after an update, equal those of a plain single-device model with the
weights of that moment, each CP rank generating half of them; and checks what is refused at construction.

Bounds: every run is float64 with transformers' and TRL's float32 upcasts widened alike in the reference and under
CP (`helpers.float64_upcasts`), so CP and TRL differ by float64 rounding: observed on the 2-core CPU VM (torch
2.13.0, transformers 5.25.0, TRL 1.16.0; 2026-12-05) at most 1.4e-14 relative for every logged number, eval_loss
6.3e-16, the saved weights 3.0e-14; the bound 1e-11 leaves 700x for other machines and versions. One exception:
the training loss that the Trainer logs at dp2 x cp2 passes through its float32 accumulator (`torch.tensor(0.0)`,
averaged over the dp processes, which differ in number: 2 against 4), so it carries a few float32 roundings
(observed 9.1e-8, 1.5 ulp); its bound, 1e-6, is 16 float32 ulps.
Mutations seen failing: see the test's docstring.
"""

from __future__ import annotations

import json
import os

import pytest

from deltacp.distributed.launch import run_distributed
import grpo_cases
from helpers import started_in_process

FLOAT64_REL = 1e-11  # every logged number, eval metrics, saved weights: float64 rounding (module docstring)
LOGGED_LOSS_REL = 1e-6  # the logged training loss at dp2 x cp2: the Trainer's float32 accumulator
CLIP_ABS = 1e-12  # clip ratios: counts over the same tokens, equal unless a ratio sits within rounding of the clip
CP2_CASES = ("grpo", "bnpo", "grpo-falcon_h1", "bnpo-qwen4_exp", "bnpo-glm5_next")
DP2_CASES = ("dr_grpo", "dapo")
EVALUATED = "grpo"


def _run(case: str, out: str, label: str, cp_size: int | None) -> dict:
    model_dir = os.path.join(out, grpo_cases.MODEL_DIRS.get(case, "model"))
    return grpo_cases.run_case(case, os.path.join(out, label), model_dir, cp_size=cp_size,
                               save=case in grpo_cases.SAVED, evaluate=case == EVALUATED)


def _dump(out: str, name: str, results: dict) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(results, f)


def _one_process(out: str) -> None:
    import torch

    torch.set_num_threads(1)
    _dump(out, "ref-1.json", {case: _run(case, out, f"ref1-{case}", None) for case in CP2_CASES})


def _check_refusals_and_kernels(out: str) -> None:
    """At CP2: settings refused at construction on every rank, naming them; transformers' train() / eval() switches
    leave the CP forwards of a from_pretrained model (hub kernels) in place."""
    model_dir = os.path.join(out, "model")

    def refused(**config) -> str:
        with pytest.raises(ValueError) as info:
            grpo_cases.build("grpo", os.path.join(out, "refused"), model_dir, cp_size=2, config_extra=config)
        return str(info.value)

    assert "use_vllm (vllm_mode='server')" in refused(use_vllm=True, vllm_mode="server")
    message = refused(cast_lm_head_to_fp32=True, per_device_train_batch_size=3, steps_per_generation=1,
                      num_generations=3, gradient_accumulation_steps=1)
    for part in ("cast_lm_head_to_fp32", "per_device_train_batch_size x steps_per_generation = 3"):
        assert part in message, (part, message)
    # GRPOConfig derived generation_batch_size from dp x cp processes: the trainer's change of it is announced
    import logging

    import torch.distributed as dist

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("deltacp.integrations.grpo").addHandler(handler)
    try:
        trainer = grpo_cases.build("grpo", os.path.join(out, "kernels"), model_dir, cp_size=2,
                                   config_extra=dict(generation_batch_size=8, steps_per_generation=None))
    finally:
        logging.getLogger("deltacp.integrations.grpo").removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    if dist.get_rank() == 0:
        assert len(warned) == 1 and ("generation batch = per_device_train_batch_size x dp x steps_per_generation = "
                                     "4 x 1 x 1 = 4 completions per round (GRPOConfig counted the 2 cp ranks as "
                                     "processes: 8)") in warned[0], warned
        assert "(steps_per_generation=2 would give 8)" in warned[0], warned
    else:
        assert not warned, warned
    gdn = trainer.model.model.layers[0].linear_attn
    trainer.model.eval()
    trainer.model.train()
    assert "forward" in gdn.__dict__, "the CP forward was removed by a train() / eval() switch"


def _check_generation(out: str) -> dict:
    """Two greedy rounds generated under CP2 (one update between them) against a plain model's greedy completions
    with the weights each round started from."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen3_5ForCausalLM

    from deltacp.integrations import CPGRPOTrainer

    rounds, shares = [], []

    class Recording(CPGRPOTrainer):
        def _generate(self, prompts):
            shares.append(len(prompts))
            return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs):
            weights = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            scored = super()._generate_and_score_completions(inputs)
            rounds.append((weights, [x["prompt"] for x in inputs], scored["completion_ids"].cpu(),
                           scored["completion_mask"].cpu()))
            return scored

    model_dir = os.path.join(out, "model")
    trainer = grpo_cases.build("grpo", os.path.join(out, "generation"), model_dir, cp_size=2, cls=Recording,
                               rollout_func=None,
                               config_extra=dict(max_steps=2, gradient_accumulation_steps=1, steps_per_generation=1,
                                                 generation_kwargs=dict(do_sample=False), learning_rate=0.05,
                                                 entropy_coef=0.1))  # greedy groups: the bonus moves the weights
    trainer.train()
    tok = trainer.processing_class
    plain = Qwen3_5ForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert len(rounds) == 2 and shares == [2, 2], (len(rounds), shares)  # 4 rows a round, 2 generated per rank

    def greedy(weights, prompts):
        plain.load_state_dict(weights)
        batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            ids = plain.generate(**batch, max_new_tokens=grpo_cases.MAX_COMPLETION, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out = []
        for generated in ids[:, batch["input_ids"].shape[1]:].tolist():
            out.append(generated[:generated.index(tok.eos_token_id) + 1] if tok.eos_token_id in generated
                       else generated)
        return out

    for weights, prompts, completion_ids, completion_mask in rounds:
        got = [ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, completion_mask)]
        assert got == greedy(weights, prompts), (prompts, got)
    # the second round's completions are those of the updated weights, not of the first round's
    stale = greedy(rounds[0][0], rounds[1][1]) != greedy(rounds[1][0], rounds[1][1])
    return dict(rounds=len(rounds), shares=shares, updated_weights_change_completions=stale)


def _worker2(rank: int, world: int, out: str) -> None:
    _check_refusals_and_kernels(out)
    generation = _check_generation(out)
    results = {case: _run(case, out, f"cp2-{case}", 2) for case in CP2_CASES}
    results.update({f"ref2-{case}": _run(case, out, f"ref2-{case}", None) for case in DP2_CASES})
    if rank == 0:
        _dump(out, "cp2.json", dict(results, generation=generation))


def _worker4(rank: int, world: int, out: str) -> None:
    results = {case: _run(case, out, f"cp4-{case}", 2) for case in DP2_CASES}
    if rank == 0:
        _dump(out, "cp4.json", results)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _compare(label: str, got: dict, ref: dict, loss_bound: float) -> list[str]:
    """Every logged number of every step; prints the worst difference of each kind against its bound."""
    failures, worst = [], {}
    assert len(got["steps"]) == len(ref["steps"]) == grpo_cases.STEPS, (label, len(got["steps"]), len(ref["steps"]))
    for step, (g, r) in enumerate(zip(got["steps"], ref["steps"])):
        assert set(g) == set(r), (label, step, sorted(set(g) ^ set(r)))
        for key, value in r.items():
            if key.startswith("clip_ratio"):
                kind, diff, bound = "clip ratios (abs)", abs(g[key] - value), CLIP_ABS
            elif key == "loss":
                kind, diff, bound = "loss", _rel(g[key], value), loss_bound
            else:
                kind, diff, bound = "the others", _rel(g[key], value), FLOAT64_REL
            worst[kind] = max(worst.get(kind, (0.0, bound)), (diff, bound))
            if not diff <= bound:
                failures.append(f"{label} step {step + 1}: {key} {g[key]!r} vs {value!r} (diff {diff:.2e} > {bound:.0e})")
    print(f"{label}: {len(got['steps'])} steps, worst " + ", ".join(
        f"{kind} {diff:.1e} (bound {bound:.0e})" for kind, (diff, bound) in worst.items()))
    return failures


def _compare_eval(got: dict, ref: dict) -> list[str]:
    failures = []
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for key, value in ref.items():
        if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second")):
            diff = _rel(got[key], value) if not key.startswith("eval_clip") else abs(got[key] - value)
            if not diff <= FLOAT64_REL:
                failures.append(f"evaluation: {key} {got[key]!r} vs {value!r} (diff {diff:.2e})")
    print(f"evaluation: eval_loss rel {_rel(got['eval_loss'], ref['eval_loss']):.1e} (bound {FLOAT64_REL:.0e})")
    return failures


def _compare_weights(got_dir: str, ref_dir: str) -> list[str]:
    import torch
    from safetensors.torch import load_file

    got, ref = (load_file(os.path.join(d, "model.safetensors")) for d in (got_dir, ref_dir))
    assert got.keys() == ref.keys() and ref[next(iter(ref))].dtype == torch.float64
    diff = torch.cat([(got[k] - ref[k]).flatten() for k in sorted(ref)]).norm()
    rel = (diff / torch.cat([ref[k].flatten() for k in sorted(ref)]).norm()).item()
    print(f"saved float64 weights: rel L2 {rel:.1e} (bound {FLOAT64_REL:.0e})")
    return [] if rel <= FLOAT64_REL else [f"saved weights rel L2 {rel:.2e} > {FLOAT64_REL:.0e}"]


def test_cp_grpo_trainer_matches_trl(tmp_path):
    """CP2 and dp2 x cp2 against TRL without CP over 3 steps; real generation under CP2; refusals.

    Mutations seen failing: the indexed attention keeping the lowest-scoring blocks (a descending=False sort:
    bnpo-qwen4_exp's grad norm 3.0e-2 off); the gathered log-probabilities' backward summed over the CP ranks
    (all_gather_seq_autograd in gather_cp_rows: every gradient x2, grad norm x2 at CP2); the 1 / dp gradient scale
    dropped (grad norm x2 at dp2 x cp2, clip ratios and weights off from step 2); dapo's global token count not
    multiplied by cp (dapo's loss and grad norm x2)."""
    import time

    out, t0 = str(tmp_path), time.time()
    grpo_cases.save_tiny_model(os.path.join(out, "model"))
    for case, directory in grpo_cases.MODEL_DIRS.items():
        grpo_cases.save_tiny_model(os.path.join(out, directory), family=case.split("-", 1)[1])
    with started_in_process(_one_process, out):  # TRL on one process beside the CP2 ranks
        run_distributed(_worker2, 2, out, timeout_s=900)
        t1 = time.time()
    t2 = time.time()
    run_distributed(_worker4, 4, out, timeout_s=900)
    print(f"times: 2 ranks {t1 - t0:.0f} s, one process {t2 - t0:.0f} s, 4 ranks {time.time() - t2:.0f} s")

    results = {}
    for name in ("ref-1", "cp2", "cp4"):
        with open(os.path.join(out, f"{name}.json")) as f:
            results[name] = json.load(f)
    print(f"generation: {results['cp2']['generation']}")
    failures = []
    pairs = [(f"{c}/cp2", results["cp2"][c], results["ref-1"][c], FLOAT64_REL) for c in CP2_CASES]
    pairs += [(f"{c}/dp2xcp2", results["cp4"][c], results["cp2"][f"ref2-{c}"], LOGGED_LOSS_REL) for c in DP2_CASES]
    for label, got, ref, loss_bound in pairs:
        failures += _compare(label, got, ref, loss_bound)
        assert any(s.get("clip_ratio/region_mean", 0) > 0 for s in ref["steps"]), f"{label}: no ratio was clipped"
        assert all(s["grad_norm"] > 0 for s in ref["steps"])
    for case in CP2_CASES + DP2_CASES:  # beta > 0 gives a KL term once the policy has moved
        if grpo_cases.CASES[case][0]["beta"] > 0:
            ref = results["ref-1"].get(case) or results["cp2"][f"ref2-{case}"]
            assert ref["steps"][-1]["kl"] > 0, case
    failures += _compare_eval(results["cp2"][EVALUATED]["eval"], results["ref-1"][EVALUATED]["eval"])
    for case in grpo_cases.SAVED:
        failures += _compare_weights(results["cp4"][case]["saved"], results["cp2"][f"ref2-{case}"]["saved"])
    assert not failures, "\n".join(failures)


def test_completion_rows_pack_and_unpack():
    """completion_rows / completion_values against TRL's slicing: the value read for completion column c of a row
    is the one at the position before it, in padded rows and in the packed row; 0 where TRL scores nothing."""
    import torch

    from deltacp.integrations.batch import completion_rows, completion_values

    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # row 3: a masked completion
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    ids = torch.arange(1, 22).reshape(3, 7) * mask
    k = completion_mask.shape[1]
    row_values = torch.arange(3 * 7, dtype=torch.float64).reshape(3, 7) + 100  # a value at every position
    expected = torch.where(completion_mask.bool(), row_values[:, 2:6], 0)  # TRL: logits at L - k - 1 .. L - 2
    padded, index = completion_rows(ids, mask, k, padding_free=False, cp=4)
    assert index is None and padded["input_ids"].shape == (3, 8) and padded["attention_mask"][:, 7].sum() == 0
    got = completion_values(row_values, None, 7, k)
    assert torch.equal(got * completion_mask, expected)
    packed, index = completion_rows(ids, mask, k, padding_free=True)
    valid = mask.bool()
    assert torch.equal(packed["input_ids"][0], ids[valid])
    assert packed["cu_seq_lens_q"].tolist() == [0, 4, 11, 12]
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0]
    assert (packed["labels"][0] != -100).nonzero().flatten().tolist() == [2, 3, 7, 8, 9, 10]
    got = completion_values(row_values[valid][None], index, 7, k)
    assert torch.equal(got, expected)


def test_padded_rows_reach_the_models_shortest_row():
    """A model whose pieces must hold the conv halo (p2p, all_gather) takes rows of at least `min_row_length`:
    completion_rows pads GRPO's rows up to it (right, masked, ignored), so that shard_collated_batch has nothing left
    to append to left-padded rows; where it would, the error names the real cause."""
    import torch

    from deltacp.integrations.batch import _padded, completion_rows
    from deltacp.parallel.placement import RowCut

    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    ids = torch.arange(1, 13).reshape(2, 6) * mask
    rows, _ = completion_rows(ids, mask, 2, padding_free=False, row_cut=RowCut("contiguous", 3), cp=4)
    assert rows["input_ids"].shape == (2, 12) and rows["attention_mask"][:, 6:].sum() == 0
    assert bool((rows["labels"][:, 6:] == -100).all()) and torch.equal(rows["input_ids"][:, :6], ids)
    rows, _ = completion_rows(ids, mask, 2, padding_free=False, row_cut=RowCut("balanced"), cp=2)
    assert rows["input_ids"].shape == (2, 8)
    labels = ids.masked_fill(mask == 0, -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    with pytest.raises(ValueError, match=r"left-padded rows of length 6 need 12 columns \(the shortest row the "
                                         r"model's pieces allow"):
        _padded(batch, ids, labels, 12, 4, 0, "cp")
    with pytest.raises(ValueError, match=r"left-padded rows of length 6 need 8 columns \(a multiple of cp=4\)"):
        _padded(batch, ids, labels, 8, 4, 0, "cp")
