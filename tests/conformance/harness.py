"""The conformance harness: one family's table (`tables.py`) run under CP on gloo, float64.

For every knob of the table (a config value away from transformers' default, or a weight pattern):
- the model is built tiny, seeded, with the knob set, then `randomize_`: every bias, norm weight and routing bias
  drawn away from transformers' init (zeros and ones hide bugs: a conv bias of zero writes nothing into a state);
  the family's decay parameters stay as the builder set them (slow: the state of one rank matters on the next);
- three inputs: "padded", a batch of two rows, the first right-padded and the second left-padded; "packed", one row
  of five documents (shorter than the conv kernel, crossing rank boundaries); "long", one row of LONG tokens;
- references, computed once and shared (`computed_once`): the unmodified transformers model on the padded batch (its
  logits at the valid tokens and the gradient of deltacp's loss on them) and on the packed row (per document), and
  deltacp's single-device path (a one-rank mesh) on all three inputs (the long row is there for CP: several chunks
  per rank; its single-device run is the padded and packed rows' code); transformers' at CP2 only (the rows a larger
  degree runs meet every input at CP2, on the same build);
- at CP2, the CP runs of `COMBOS` (`combos_of`): the defaults row (touches "all") all six, every linear-attention
  mode in both sequence layouts, each full-attention method twice, each input twice; a row that changes a sequence
  part (linear, attention, rope, layers, padding) three, every mode, every input and every full-attention method
  once, in one layout (contiguous and balanced by turns over the rows: every layout meets every mode and input in
  each table); a token-wise row (MLP, MoE, norms, embeddings, the head) one, in turn, never on the long row (so
  that transformers runs its input too). CP against the single-device path within 1e-8 (this rank's logits, the
  loss, every gradient summed over ranks, the grad norm); the single-device path against transformers within float32-level bounds
  (`TRANSFORMERS_BOUNDS`: transformers computes its norms, gates and fallbacks in float32 even in a float64 model).
A knob deltacp refuses is run as a refusal: `parallelize_cp` or the first forward must raise, on every rank, an error
naming it. A knob transformers ignores is listed with the reason and not run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deltacp import cp_cross_entropy, parallelize_cp, shard_batch_for_cp
from helpers import computed_once, cp_mesh, flat, float64_upcasts, full_tensors, grads_of, rel_l2, self_meshes

S = 64  # tokens of a padded or packed row
LONG = 160  # tokens of the long row (two chunks of 64 per rank at CP2)
LENGTHS = [1, 3, 29, 31]  # the packed row's documents: two shorter than the conv kernel, two crossing rank boundaries
PAD_RIGHT, PAD_LEFT = 45, 19  # row 0 valid up to PAD_RIGHT, row 1 from PAD_LEFT
COMBOS = (  # (linear-attention mode, sequence layout, full-attention method, input); the even ones contiguous, the
    # odd ones balanced: each half holds every mode, input and full-attention method once
    ("ulysses", "contiguous", "ulysses", "padded"),
    ("ulysses", "balanced", "ulysses", "long"),
    ("p2p", "contiguous", "all_gather", "packed"),
    ("p2p", "balanced", "ring", "padded"),
    ("all_gather", "contiguous", "ring", "long"),
    ("all_gather", "balanced", "all_gather", "packed"),
)
TOKEN_WISE_COMBOS = (0, 2, 3, 5)  # the COMBOS a token-wise row takes in turn: both layouts, every mode, not "long"
SEQUENCE_PARTS = {"all", "linear", "attention", "rope", "layers", "padding"}  # what the CP modes and layouts act on
CP_BOUND = 1e-8
TRANSFORMERS_BOUNDS = {"logits": 1e-6, "loss": 1e-6, "grads": 1e-4}


@dataclass(frozen=True)
class Knob:
    """One row of a family's table: `name` (the config field, or a weight pattern), `overrides` (config fields
    the builder passes to the config class), `touches` (the parts of the forward it changes), `value` (what the row
    sets, for the README's table), `refused` (a fragment of the error deltacp must raise: the row runs as a
    refusal), and for rows that are not run: `ignored` (why transformers' forward does not read it) or `elsewhere`
    (a field that changes no logits, a loss term: the test that checks it)."""

    name: str
    overrides: dict = field(default_factory=dict)
    touches: str = ""
    refused: str | None = None
    ignored: str | None = None
    elsewhere: str | None = None  # a field that changes no logits (a loss term): where it is checked

    @property
    def runs(self) -> bool:
        return self.ignored is None and self.elsewhere is None

    @property
    def token_wise(self) -> bool:
        """Touches no part the CP modes act on (MLP, MoE, norms, embeddings, the head: transformers' own per-token
        code): one of the six runs suffices (`combos_of`: every mode and layout still meets it across the rows)."""
        return not (set(self.touches.replace(",", " ").split()) & SEQUENCE_PARTS)


@dataclass(frozen=True)
class Table:
    """A family's conformance table: its causal-LM class, a builder `build(**overrides) -> model` (tiny, seeded,
    float64, the decays slow) and its knobs."""

    family: str
    model_class: str
    build: Callable[..., torch.nn.Module]
    knobs: tuple[Knob, ...]
    # the full-attention methods its attention layers take (None: every one); a run of another method takes the
    # first of these instead (e.g. indexed attention: all_gather only, the others refused: test_qwen4_exp.py)
    attention_methods: tuple[str, ...] | None = None
    valid_runs: bool = False  # transformers' reference of a padded row: its valid tokens alone (transformers_reference)

    def attention_for(self, method: str) -> str:
        return method if self.attention_methods is None or method in self.attention_methods else \
            self.attention_methods[0]


def randomize_(model: torch.nn.Module, seed: int = 99, keep: tuple[str, ...] = ()) -> torch.nn.Module:
    """Every bias (parameters and buffers named *bias, routing correction biases included) drawn from N(0, 0.2^2),
    every norm weight moved by N(0, 0.2^2) (away from ones, or from zeros for the (1 + w) norms); names containing
    one of `keep` (the family's decay parameters: A_log, dt_bias, ...) left as the builder set them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        for name, t in tensors:
            if not t.is_floating_point() or any(k in name for k in keep):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("bias"):
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) * 0.2)
            elif leaf == "weight" and "norm" in name.lower():
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) * 0.2)
    return model


def batches() -> dict:
    """The three inputs: (ids, padding mask or None, cu_seqlens or None)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (2, S), generator=gen)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[0, PAD_RIGHT:] = 0
    mask[1, :PAD_LEFT] = 0
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    return {"padded": (ids, mask, None),
            "packed": (torch.randint(3, 256, (1, sum(LENGTHS)), generator=gen), None, cu),
            "long": (torch.randint(3, 256, (1, LONG), generator=gen), None, None)}


def _valid_targets(batch: dict) -> torch.Tensor:
    """A cut batch's targets, also ignored where the INPUT token is padding. deltacp's (and transformers' labels
    convention) keep the first valid token of a left-padded row as the target of the last padding position, whose
    logits are not defined (it attends to padding only: a padding document under CP, transformers' unmasked
    fully-masked rows in one process); a comparison with transformers cannot include them."""
    mask = batch.get("attention_mask")
    targets = batch["target_ids"]
    return targets if mask is None else torch.where(mask.bool(), targets, torch.full_like(targets, -100))


def _targets(single, ids, mask, cu) -> torch.Tensor:
    """The whole row's targets (`_valid_targets`) for the one-rank mesh `single`."""
    return _valid_targets(shard_batch_for_cp(ids, single, attention_mask=mask, cu_seqlens=cu))


def _valid_runs_logits(model, ids, mask):
    """[B, S, V] the model's logits on each row's valid tokens alone (one contiguous run per row; zeros elsewhere)."""
    rows = []
    for b in range(ids.shape[0]):
        where = mask[b].bool().nonzero()[:, 0]
        lo, hi = int(where[0]), int(where[-1]) + 1
        assert hi - lo == where.numel(), "one contiguous run of valid tokens per row"
        part = model(input_ids=ids[b:b + 1, lo:hi], use_cache=False).logits
        rows.append(F.pad(part, (0, 0, lo, ids.shape[1] - hi)))
    return torch.cat(rows, dim=0)


def transformers_reference(model, single, ids, mask, cu, valid_runs: bool = False):
    """The unmodified model: logits (per document for a packed row) and the gradient of the mean cross entropy of
    deltacp's targets on them. -> (logits, loss, flat grads). Runs on `model` itself (no copy: its gradients are
    cleared again before returning, so the copies CP runs take hold none). valid_runs: a padded row is run as its
    valid tokens alone (a NoPE model whose padding transformers itself zeroes, where the padded run cannot be: GLM's
    float64 eager softmax of a fully masked padded query is NaN, which the next layers' zero-weighted values carry
    to every token)."""
    if cu is None and mask is not None and valid_runs:
        logits = _valid_runs_logits(model, ids, mask)
    elif cu is None:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    else:
        b = cu.tolist()
        logits = torch.cat([model(input_ids=ids[:, x:y], use_cache=False).logits for x, y in zip(b[:-1], b[1:])],
                           dim=1)
    loss = F.cross_entropy(logits.flatten(0, 1), _targets(single, ids, mask, cu).flatten(), ignore_index=-100)
    loss.backward()
    grads = flat(grads_of(model))
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach(), grads


def cp_step(model, mesh, ids, mask, cu, sharded: bool = False):
    """One forward + backward of a CP'd model on this rank's slice: (logits, loss, flat grads summed over ranks: one
    all-reduce of the flattened gradients, the sum `all_reduce_cp_grads` computes; `sharded`: the model is
    under FSDP2 over the mesh, its gradients already summed, gathered whole)."""
    batch = shard_batch_for_cp(ids, mesh, attention_mask=mask, cu_seqlens=cu, model=model)
    with float64_upcasts():
        logits = model(**{k: v for k, v in batch.items() if k != "target_ids" and v is not None},
                       use_cache=False).logits
        loss = cp_cross_entropy(logits, _valid_targets(batch), mesh)
        loss.backward()
    if sharded:
        return logits.detach(), loss.detach(), flat(full_tensors({
            n: p.grad if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
            for n, p in model.named_parameters()}))
    grads = flat(grads_of(model))
    if mesh.size() > 1:
        dist.all_reduce(grads, group=mesh.get_group())
    return logits.detach(), loss.detach(), grads


def run_against_references(rank: int, world: int, base, inputs: dict, combos, compare_transformers: bool,
                           fsdp: bool = False, valid_runs: bool = False, tf_bound: float = 1e-6,
                           checkpoint_policy: str = "full", **settings) -> None:
    """`base` (a tiny float64 model) under CP at `world` ranks in each (linear mode, sequence layout, input kind) of
    `combos` (`inputs`: kind -> (ids, padding mask, cu_seqlens)), against deltacp's single-device path (CP_BOUND:
    this rank's logits, the loss, the rank-summed gradients) and, with `compare_transformers`, the unmodified model at
    the valid tokens (`tf_bound`; gradients 100x; `valid_runs`: `transformers_reference`'s). fsdp: activation
    checkpointing (`checkpoint_policy`), then FSDP2 over the CP mesh, on the CP'd model (deltacp's order). settings:
    parallelize_cp's
    other keywords (e.g. full_attention_cp). Prints each run's figures on rank 0; raises listing every failure."""
    from deltacp import apply_activation_checkpointing, fully_shard_cp

    single, mesh = self_meshes(), cp_mesh()
    failures, refs = [], {}
    for mode, layout, kind in combos:
        ids, m, cu = inputs[kind]
        if kind not in refs:
            one = parallelize_cp(copy.deepcopy(base), single, linear_attention_cp_mode="p2p", **settings)
            refs[kind] = (cp_step(one, single, ids, m, cu), transformers_reference(base, single, ids, m, cu, valid_runs)
                          if compare_transformers else None)
        (logits_1, loss_1, grads_1), theirs = refs[kind]
        model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode, sequence_layout=layout,
                               **settings)
        if fsdp:
            apply_activation_checkpointing(model, policy=checkpoint_policy)
            fully_shard_cp(model, mesh)
        logits, loss, grads = cp_step(model, mesh, ids, m, cu, sharded=fsdp)
        mine = _rank_positions(model, mesh, ids, cu)
        kept = mine < ids.shape[1]
        valid = (torch.ones(ids.shape, dtype=torch.bool) if m is None else m.bool())[:, mine[kept]]
        checks = {"logits": rel_l2(logits[:, kept], logits_1[:, mine[kept]]), "loss": abs(loss / loss_1 - 1).item(),
                  "grads": rel_l2(grads, grads_1)}
        tag = f"CP{world} {mode} {layout} {kind}"
        failures += [f"{tag}: {k} {v:.2e}" for k, v in checks.items() if not v < CP_BOUND]
        tf = {}
        if theirs is not None:
            tf = {"logits vs transformers": rel_l2(logits[:, kept][valid], theirs[0][:, mine[kept]][valid]),
                  "loss vs transformers": abs(loss / theirs[1] - 1).item(),
                  "grads vs transformers": rel_l2(grads, theirs[2])}
            failures += [f"{tag}: {k} {v:.2e}" for k, v in tf.items()
                         if not v < (100 * tf_bound if k.startswith("grads") else tf_bound)]
        if rank == 0:
            print(f"{tag}: " + ", ".join(f"{k} {v:.1e}" for k, v in {**checks, **tf}.items()))
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _rank_positions(model, mesh, ids, cu) -> torch.Tensor:
    """This rank's row positions (a packed row may be padded by the cut: positions >= its length)."""
    batch = shard_batch_for_cp(torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1), mesh, model=model,
                               cu_seqlens=cu)
    return batch["input_ids"][0]


def build_knob(table: Table, knob: Knob, keep: tuple[str, ...]):
    return randomize_(table.build(**knob.overrides), keep=keep)


def combos_of(knob: Knob, index: int, rotate: bool = False) -> tuple:
    """The runs of the table's `index`-th knob: all six for a row touching "all" (the defaults); three for a row
    touching a sequence part (one layout's half of `COMBOS`: every mode, input and full-attention method once, the
    layout by turns); one for a token-wise knob (in turn, `TOKEN_WISE_COMBOS`); with `rotate` (the larger CP degrees), one, in turn, so
    that the table's rows still meet all six, and none for a token-wise or attention-only knob."""
    if rotate:  # the attention-only rows too: what a larger degree changes is the sequence parts' work and halos
        attention_only = set(knob.touches.split()) == {"attention"}
        return () if knob.token_wise or attention_only else (COMBOS[index % len(COMBOS)],)
    if "all" in knob.touches.split():
        return COMBOS
    if not knob.token_wise:
        return COMBOS[index % 2::2]  # contiguous (0, 2, 4) or balanced (1, 3, 5)
    # token-wise: CP cannot change a per-token part, so one run, in turn among those whose input transformers also
    # runs (padded or packed: the knob is compared with transformers on it)
    return (COMBOS[TOKEN_WISE_COMBOS[index % len(TOKEN_WISE_COMBOS)]],)


def run_table(rank: int, world: int, table: Table, keep: tuple[str, ...], knob_names=None, rotate: bool = False):
    """Every knob of `table` at CP `world` (the spawned worker's body; `rotate`: one run per knob, `combos_of`).
    A Ulysses run whose heads the CP degree does not divide must be refused (ValueError naming the setting); the
    same run then goes through p2p. Returns nothing; raises listing every failure with its figure."""
    single, mesh = self_meshes(), cp_mesh()
    inputs = batches()
    failures, worst, checked = [], {}, 0
    for index, knob in enumerate(table.knobs):
        if knob_names is not None and knob.name not in knob_names:
            continue
        if not knob.runs:
            continue
        combos = combos_of(knob, index, rotate)
        if not combos:
            continue
        tag = f"{table.family} [{knob.name}]"
        if knob.refused is not None:
            failures += _refusal(table, knob, keep, mesh, inputs, tag)
            continue
        base = build_knob(table, knob, keep)

        def references(kind):
            ids, m, cu = inputs[kind]
            ref_model = parallelize_cp(copy.deepcopy(base), single, linear_attention_cp_mode="p2p",
                                       full_attention_cp=table.attention_for("ulysses"))
            # the single-device path against transformers: at CP2 (every input of this row, the same build and
            # inputs); the rotated degrees compare CP against the single-device path alone
            theirs = None if kind == "long" or rotate else transformers_reference(base, single, ids, m, cu,
                                                                                   table.valid_runs)
            return theirs, cp_step(ref_model, single, ids, m, cu)

        kinds = sorted({c[3] for c in combos})
        refs = dict(zip(kinds, computed_once(*(partial(references, kind) for kind in kinds))))
        for kind in kinds:  # deltacp's single-device path against the unmodified model
            if refs[kind][0] is None:
                continue
            (logits_tf, loss_tf, grads_tf), (logits_1, loss_1, grads_1) = refs[kind]
            ids, m, cu = inputs[kind]
            valid = torch.ones(ids.shape, dtype=torch.bool) if m is None else m.bool()
            checks = {"logits": rel_l2(logits_1[valid], logits_tf[valid]), "loss": abs(loss_1 / loss_tf - 1).item(),
                      "grads": rel_l2(grads_1, grads_tf)}
            failures += [f"{tag} {kind}: single device vs transformers {k} {v:.2e} > {TRANSFORMERS_BOUNDS[k]}"
                         for k, v in checks.items() if not v < TRANSFORMERS_BOUNDS[k]]
        for mode, layout, attention, kind in combos:
            attention = table.attention_for(attention)
            ids, m, cu = inputs[kind]
            _, (logits_1, loss_1, grads_1) = refs[kind]
            try:
                model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode,
                                       sequence_layout=layout, full_attention_cp=attention)
            except ValueError as e:
                if "ulysses" not in (mode, attention) or "divisible by" not in str(e):
                    raise
                mode, attention = "p2p", "all_gather"  # refused as it must be: the same input through p2p
                model = parallelize_cp(copy.deepcopy(base), mesh, linear_attention_cp_mode=mode,
                                       sequence_layout=layout, full_attention_cp=attention)
            logits, loss, grads = cp_step(model, mesh, ids, m, cu)
            mine = _rank_positions(model, mesh, ids, cu)
            kept = mine < ids.shape[1]
            checks = {"logits": rel_l2(logits[:, kept], logits_1[:, mine[kept]]), "loss": abs(loss / loss_1 - 1).item(),
                      "grads": rel_l2(grads, grads_1),
                      "grad norm": abs(grads.norm().item() / grads_1.norm().item() - 1)}
            failures += [f"{tag} CP{world} {mode} {layout} attention={attention} {kind}: {k} {v:.2e}"
                         for k, v in checks.items() if not v < CP_BOUND]
            for k, v in checks.items():
                worst[k] = max(worst.get(k, 0.0), v)
            checked += 1
    if rank == 0:
        print(f"{table.family} CP{world}: {checked} CP runs, worst against the single-device path: "
              + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _refusal(table: Table, knob: Knob, keep, mesh, inputs, tag) -> list[str]:
    """The knob must be refused on every rank, naming it, at parallelize_cp or the first forward."""
    try:
        model = parallelize_cp(build_knob(table, knob, keep), mesh, linear_attention_cp_mode="p2p",
                               full_attention_cp=table.attention_for("ulysses"))
        ids, m, cu = inputs["padded"]
        cp_step(model, mesh, ids, m, cu)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return [] if knob.refused in str(e) else [f"{tag}: refused with {type(e).__name__}: {e}; expected a message "
                                                  f"containing {knob.refused!r}"]
    return [f"{tag}: expected a refusal containing {knob.refused!r}; CP ran"]
