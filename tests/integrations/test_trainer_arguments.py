"""The trainers' activation checkpointing arguments under either transformers' names: `activation_checkpointing` in
recent releases (`gradient_checkpointing` its deprecated alias), `gradient_checkpointing` only in older ones (5.17,
the GPU machine's). `checkpointing_arguments` gives the installed release's names; the integrations read either."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest

from deltacp.integrations import checkpointing_arguments
from deltacp.integrations.trainer import trainer_checkpointing

pytestmark = pytest.mark.fast


def test_checkpointing_arguments_build_training_arguments_without_warnings(tmp_path):
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    given = checkpointing_arguments(policy="selective", every_n_layers=2)
    assert set(given) <= names, (given, "fields the installed TrainingArguments lacks")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated alias
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **given)
    assert trainer_checkpointing(args) == (True, {"policy": "selective", "every_n_layers": 2})
    assert checkpointing_arguments() == {next(iter(given)): True}
    assert trainer_checkpointing(TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)) == (False, {})


def test_older_transformers_names_are_read():
    old = types.SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True})
    assert trainer_checkpointing(old) == (True, {"selective": True})
    new = types.SimpleNamespace(activation_checkpointing=True, activation_checkpointing_kwargs=None,
                                gradient_checkpointing=False, gradient_checkpointing_kwargs={"selective": True})
    assert trainer_checkpointing(new) == (True, {})  # the new name wins where it exists
    assert trainer_checkpointing(types.SimpleNamespace(gradient_checkpointing=None)) == (False, {})
