"""The CP plan: one validated object for every CP setting, taken whole or built from the old keywords by every
consumer (parallelize_cp, the trainer's YAML section, the integrations)."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3_5ForCausalLM

from deltacp import CPPlan, cp_plan_of, parallelize_cp, row_cut_of
from deltacp.config import AcceleratorConfig
from deltacp.parallel.placement import RowCut
from helpers import tiny_config

pytestmark = pytest.mark.fast


def test_a_plan_validates_each_rule_once_naming_the_setting():
    plan = CPPlan(linear_attention_cp_mode="allgather", full_attention_cp="allgather")
    assert (plan.linear_attention_cp_mode, plan.full_attention_cp) == ("all_gather", "all_gather")  # one spelling
    with pytest.raises(ValueError, match=r"^linear_attention_cp_mode='p2pp' is not supported; expected one of"):
        CPPlan(linear_attention_cp_mode="p2pp")
    with pytest.raises(ValueError, match=r"^train\.accelerator\.sequence_layout='zigzag' is not supported"):
        CPPlan(sequence_layout="zigzag", prefix="train.accelerator.")
    with pytest.raises(ValueError, match=r"linear_attention_state_passing='scan' schedules the state hops of a mode "
                                         r"that has them \(p2p\); linear_attention_cp_mode='ulysses' has none"):
        CPPlan(linear_attention_state_passing="scan")
    with pytest.raises(NotImplementedError, match=r"linear_attention_cp_mode='all_gather' has no triton backend"):
        CPPlan(linear_attention_cp_mode="all_gather", linear_attention_backend="triton")
    with pytest.raises(ValueError, match=r"ulysses_degree=3 is not supported at cp=4"):
        CPPlan(cp=4, ulysses_degree=3)
    with pytest.raises(ValueError, match=r"cp must be an integer >= 1, got 0"):
        CPPlan(cp=0)
    with pytest.raises(ValueError, match=r"^full_attention_cp='bogus' is not supported; expected one of \('ulysses', "
                                         r"'all_gather', 'ring'\)"):  # at construction, cp unknown (was: at apply)
        CPPlan(full_attention_cp="bogus")
    with pytest.raises(ValueError, match=r"^linear_attention_backend=None is not supported; expected one of "
                                         r"\('eager', 'triton'\)"):  # (it built: None skipped the backend check)
        CPPlan(linear_attention_backend=None)
    # what the settings imply, asked of the plan
    assert CPPlan(linear_attention_cp_mode="p2p").row_cut(3) == RowCut("contiguous", 3)
    assert CPPlan(linear_attention_cp_mode="ulysses").row_cut(3) == RowCut("contiguous", 1)
    assert CPPlan(sequence_layout="balanced").row_cut(3).pieces(4) == 8


def test_resolve_takes_a_plan_or_the_keywords_not_both():
    plan = CPPlan.resolve(None, dict(linear_attention_cp_mode="p2p"), cp=4)
    assert plan == CPPlan(cp=4, linear_attention_cp_mode="p2p")
    assert CPPlan.resolve(CPPlan(linear_attention_cp_mode="p2p"), {}, cp=4) == plan  # cp from the mesh
    with pytest.raises(ValueError, match=r"give the CP settings as plan=CPPlan\(\.\.\.\) or as keywords, not both"):
        CPPlan.resolve(plan, dict(sequence_layout="balanced"), cp=4)
    with pytest.raises(ValueError, match=r"the plan's cp=2 is not the CP mesh's degree \(4\)"):
        CPPlan.resolve(CPPlan(cp=2), {}, cp=4)
    with pytest.raises(TypeError, match=r"unknown keyword 'linear_attention_mode'; the CP settings are \['cp', "):
        CPPlan.resolve(None, dict(linear_attention_mode="p2p"), cp=4)


def test_parallelize_cp_takes_a_plan_or_the_old_keywords(single_rank_group):
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    base = Qwen3_5ForCausalLM(tiny_config())
    a = parallelize_cp(copy.deepcopy(base), mesh, CPPlan(linear_attention_cp_mode="p2p", sequence_layout="balanced"))
    b = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode="p2p", sequence_layout="balanced")
    c = parallelize_cp(copy.deepcopy(base), mesh, 1, linear_attention_cp_mode="p2p")  # older positional ulysses_degree
    assert cp_plan_of(a) == cp_plan_of(b) == CPPlan(cp=1, linear_attention_cp_mode="p2p", sequence_layout="balanced")
    assert cp_plan_of(c).ulysses_degree == 1
    assert row_cut_of(a) == row_cut_of(b) and row_cut_of(a).min_piece_length == 3
    ids = torch.randint(0, 256, (1, 16))
    assert torch.equal(a(input_ids=ids, use_cache=False).logits, b(input_ids=ids, use_cache=False).logits)


def test_the_trainer_section_is_the_plan_plus_dp_and_tp():
    acc = AcceleratorConfig.from_dict(dict(cp=4, dp=2, linear_attention_cp_mode="allgather", sequence_layout="balanced"))
    assert acc.plan == CPPlan(cp=4, linear_attention_cp_mode="all_gather", sequence_layout="balanced")
    assert (acc.cp, acc.dp, acc.linear_attention_cp_mode) == (4, 2, "all_gather")  # the plan's fields read through
    assert AcceleratorConfig.keys() == ("dp", "tp") + CPPlan.setting_names()  # a new setting: a plan field
    assert AcceleratorConfig.from_dict(acc.to_dict()) == acc
    assert acc.replace(cp=2, dp=None).plan.cp == 2
    with pytest.raises(ValueError, match=r"^train\.accelerator\.full_attention_cp='rng' is not supported"):
        AcceleratorConfig.from_dict(dict(full_attention_cp="rng"))


def test_the_integrations_take_every_plan_field_at_construction():
    """The CP trainer's keywords are the plan's fields (no list of its own): a setting only the plan knows reaches
    the plan's rules before the trainer prepares anything."""
    from deltacp.integrations import CPTrainer

    with pytest.raises(ValueError, match=r"deltacp: linear_attention_state_passing='scan' schedules the state hops"):
        CPTrainer(model=None, cp_size=2, linear_attention_state_passing="scan")
    with pytest.raises(ValueError, match=r"deltacp: the CP trainer: give the CP settings as plan=CPPlan\(\.\.\.\) or as "
                                         r"keywords, not both \(got plan and \['sequence_layout'\]\)"):
        CPTrainer(model=None, cp_size=2, plan=CPPlan(), sequence_layout="balanced")
    with pytest.raises(ValueError, match=r"deltacp: the CP trainer: the plan's cp=4 is not cp_size \(2\)"):
        CPTrainer(model=None, cp_size=2, plan=CPPlan(cp=4))


def test_a_checkpointing_plan_checks_its_settings_when_built():
    """CheckpointingPlan refuses what apply_activation_checkpointing would, when it is built (one check for both)."""
    from deltacp.models.checkpointing import CheckpointingPlan

    for bad, message in ((dict(policy="partial"), "policy='partial' is not an activation checkpointing policy"),
                         (dict(every_n_layers=0), "every_n_layers=0 must be an integer >= 1"),
                         (dict(num_layers=-1), "num_layers=-1 must be None or an integer >= 0")):
        with pytest.raises(ValueError, match=message):
            CheckpointingPlan(**bad)


def test_the_backend_setting_under_its_earlier_name():
    """linear_attention_gdn_backend (it selects the Mamba2 and KDA kernels too) is linear_attention_backend now; the
    old name still works as a keyword, a YAML key and a CPPlan argument, with a FutureWarning naming the new one, and
    both names with different values are an error."""
    from deltacp.config import AcceleratorConfig
    from deltacp.parallel.plan import CPPlan

    with pytest.warns(FutureWarning, match="linear_attention_gdn_backend is deprecated; it is linear_attention_backend"):
        plan = CPPlan.resolve(None, {"linear_attention_gdn_backend": "eager", "linear_attention_cp_mode": "p2p"}, 2)
    assert plan.linear_attention_backend == "eager" and "linear_attention_gdn_backend" not in plan.settings()
    with pytest.warns(FutureWarning, match=r"train\.accelerator\.linear_attention_gdn_backend is deprecated"):
        acc = AcceleratorConfig.from_dict({"cp": 2, "linear_attention_gdn_backend": "eager"})
    assert acc.linear_attention_backend == acc.linear_attention_gdn_backend == "eager"
    assert "linear_attention_gdn_backend" not in acc.to_dict()
    with pytest.warns(FutureWarning, match="CPPlan: linear_attention_gdn_backend is deprecated"):
        assert CPPlan(linear_attention_gdn_backend="eager").linear_attention_backend == "eager"
    with pytest.raises(ValueError, match=r"linear_attention_gdn_backend='triton' \(deprecated\) and "
                                         r"linear_attention_backend='eager' disagree"), pytest.warns(FutureWarning):
        CPPlan.resolve(None, {"linear_attention_gdn_backend": "triton", "linear_attention_backend": "eager"}, 2)
