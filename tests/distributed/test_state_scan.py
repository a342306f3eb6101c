"""The log-depth state scan (`parallel/scan.py`, p2p `state_passing="scan"`) on gloo, float64.

- the primitive: in one process at every n up to 33 (lockstep simulation), then over real groups of 2, 3, 5, 6, 8
  and 16 ranks (one 16-rank spawn), forward and reverse (transposed maps, the backward), against the sequential
  chain to 1e-12, with M zero or absent on some ranks; the message log depends on the group size only;
- the GDN layer in p2p mode with "scan" at CP5 (3 rounds, a non-power of two): outputs, input and parameter
  gradients against the chain (1e-12) and deltacp's single device (1e-8), unpacked and packed (documents crossing
  ranks, a rank whose first document starts on it, ranks with M = 0);
- the model (packed row) with and without activation checkpointing: gradients against the chain (1e-12) and the
  single device (1e-8), and identical p2p message logs (a recompute replays H_in and posts nothing).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from deltacp import (
    LinearAttentionContextParallel,
    all_reduce_cp_grads,
    cp_cross_entropy,
    parallelize_qwen3_5_cp,
    shard_batch_for_cp,
)
from deltacp.distributed.collectives import StatePassing
from deltacp.parallel.placement import Pieces
from deltacp.parallel.scan import exclusive_state_scan, scan_rounds, scan_schedule, simulate_exclusive_scan
from deltacp.distributed.launch import run_distributed
from deltacp.models.checkpointing import apply_activation_checkpointing
from deltacp.train.trainer import p2p_passings
from helpers import (cp_mesh, flat, grads_of, local_slice, long_memory_gates_, rel_l2, run_fwd_bwd, self_meshes,
                     summed_over_ranks, tiny_config)

EXACT = 1e-12  # scan vs chain: the same products, associated differently
TIGHT = 1e-8  # CP vs deltacp's single device (float64)
SHAPE = (2, 3, 6, 5)  # B, H, K, V (K != V, so a transposed or misplaced block cannot pass)


def _maps(n: int, seed: int, zero: set[int], explicit_zero: set[int] = frozenset()):
    """n maps (M, S) in float64; M None (absent) at positions in `zero`, an all-zero tensor at `explicit_zero`."""
    gen = torch.Generator().manual_seed(seed)
    B, H, K, V = SHAPE
    ms, ss = [], []
    for p in range(n):
        m = torch.randn(B, H, K, K, generator=gen, dtype=torch.float64) / K**0.5 + 0.3 * torch.eye(K).double()
        ms.append(None if p in zero else torch.zeros_like(m) if p in explicit_zero else m)
        ss.append(torch.randn(B, H, K, V, generator=gen, dtype=torch.float64))
    return ms, ss


def _chain(ms, ss):
    """State entering each position from a zero state, hop by hop (None at position 0)."""
    out, h = [], None
    for m, s in zip(ms, ss):
        out.append(h)
        h = s if h is None or m is None else m @ h + s
    return out


def _close(got, ref, what):
    if ref is None:
        assert got is None, f"{what}: expected nothing, got a tensor"
        return
    assert got is not None and got.dtype == ref.dtype, f"{what}: got {None if got is None else got.dtype}"
    err = rel_l2(got, ref)
    assert err < EXACT, f"{what}: rel err {err:.3e}"


@pytest.mark.fast
@pytest.mark.parametrize("n", list(range(1, 34)))
def test_scan_in_process_matches_chain(n):
    zero = {p for p in range(n) if p % 3 == 1}  # documents starting inside those slices
    ms, ss = _maps(n, seed=n, zero=zero | {0}, explicit_zero={p for p in range(n) if p % 5 == 4})
    got = simulate_exclusive_scan(ms, ss)
    for p, (g, r) in enumerate(zip(got, _chain(ms, ss))):
        _close(g, r, f"n={n} position {p}")
    # the backward: the same scan over the ranks in reverse order with transposed maps
    rev_m = [None if m is None else m.mT for m in reversed(ms)]
    got = simulate_exclusive_scan(rev_m, list(reversed(ss)))
    for p, (g, r) in enumerate(zip(got, _chain(rev_m, list(reversed(ss))))):
        _close(g, r, f"n={n} reverse position {p}")


@pytest.mark.fast
def test_scan_schedule_is_static_and_log_depth():
    for n in range(1, 40):
        schedules = [scan_schedule(p, n) for p in range(n)]
        assert all(len(s) == scan_rounds(n) for s in schedules)
        assert scan_rounds(n) == (0 if n == 1 else (n - 1).bit_length())
        for d in range(scan_rounds(n)):
            for p in range(n):
                rnd = schedules[p][d]
                assert rnd.offset == 1 << d
                if rnd.send_to is not None:  # every message has its receive, with the same shape
                    peer = schedules[rnd.send_to][d]
                    assert peer.recv_from == p and peer.recv_m == rnd.send_m, (n, p, d)
    # float32 (and bf16) summaries scan in float32; the result has the state's compute dtype
    ms, ss = _maps(5, 0, zero={0})
    got = simulate_exclusive_scan([None if m is None else m.bfloat16() for m in ms], [s.bfloat16() for s in ss])
    assert all(g.dtype == torch.float32 for g in got[1:])


@pytest.mark.fast
def test_unknown_state_passing_raises_at_construction():
    with pytest.raises(ValueError, match="state_passing='tree'"):
        LinearAttentionContextParallel(mode="p2p", state_passing="tree")


# ---------------------------------------------------------------------------------------------------------------
# The primitive over real groups (gloo)
# ---------------------------------------------------------------------------------------------------------------


def _scan_on_group(group, size, failures):
    """On every member of `group`, for both sequence layouts (one piece per rank, or pieces r and 2P - 1 - r):
    forward and reverse scan against the chain over the pieces; the message log must not depend on which maps are
    zero."""
    passing = StatePassing(group, "scan")
    r = passing.rank
    for balanced in (False, True):
        n = 2 * size if balanced else size
        mine = [r, 2 * size - 1 - r] if balanced else [r]  # this rank's pieces, written out here
        pieces = Pieces(r, size, balanced, len(mine))
        logs = []
        for seed, zero, explicit in ((size, {0}, set()), (size + 100, {0, 2, n - 1}, {1}),
                                     (size + 200, set(range(n)), set())):
            ms, ss = _maps(n, seed, zero, explicit)
            passing.log = []
            h_in = exclusive_state_scan([ms[p] for p in mine], [ss[p] if p < n - 1 else None for p in mine], passing,
                                        pieces, state_shape=SHAPE, dtype=torch.float64, device="cpu")
            rev_m = [None if m is None else m.mT for m in ms]
            d_out = exclusive_state_scan([rev_m[p] for p in mine], [ss[p] if p > 0 else None for p in mine], passing,
                                         pieces, state_shape=SHAPE, dtype=torch.float64, device="cpu", reverse=True,
                                         what="dH")
            logs.append(passing.log)
            forward_ref = _chain(ms, ss)
            backward_ref = _chain(list(reversed(rev_m)), list(reversed(ss)))
            try:
                for slot, p in enumerate(mine):
                    _close(h_in[slot], forward_ref[p], f"P={size} balanced={balanced} rank {r} piece {p} forward")
                    _close(d_out[slot], backward_ref[n - 1 - p], f"P={size} balanced={balanced} rank {r} piece {p} back")
            except AssertionError as e:
                failures.append(str(e))
        if any(log != logs[0] for log in logs):
            failures.append(f"P={size} balanced={balanced} rank {r}: message log depends on the data: {logs}")
        n_messages = sum(1 for e in logs[0] if e.startswith(("send H", "recv H")))
        if n_messages > 2 * len(mine) * scan_rounds(n):
            failures.append(f"P={size} balanced={balanced} rank {r}: {n_messages} forward messages for "
                            f"{scan_rounds(n)} rounds")


def scan_groups_worker(rank, world):
    failures = []
    # groups of 2, 3, 5, 6 side by side, then two of 8, then all 16 (every rank creates every group, in order)
    for sizes in ((2, 3, 5, 6), (8, 8), (16,)):
        start, mine = 0, None
        for size in sizes:
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = (group, size)
            start += size
        _scan_on_group(*mine, failures)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_scan_over_groups_of_2_to_16_ranks():
    run_distributed(scan_groups_worker, 16, timeout_s=300)


# ---------------------------------------------------------------------------------------------------------------
# The GDN layer and the model in p2p mode with the scan (CP5)
# ---------------------------------------------------------------------------------------------------------------

SEQ = 320  # 64 tokens a rank at CP5
# document starts 0, 1, 3, 40, 104, 107, 207, 208, 256: ranks 0, 1, 3 have starts inside (M = 0), rank 2 none
# (its document crosses from rank 1 to rank 3), rank 4's first document starts at its first token
DOCS = [1, 2, 37, 64, 3, 100, 1, 48, 64]


def _grads_summed(module):
    return flat(summed_over_ranks(grads_of(module)))


def _layer_checks(rank, world, failures):
    torch.manual_seed(3)
    base = long_memory_gates_(Qwen3_5GatedDeltaNet(tiny_config(), 0).double())
    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist())
    single, mesh = self_meshes(), cp_mesh()
    for label, B, kwargs in (("unpacked", 2, {}), ("packed", 1, {"cu_seq_lens_q": cu})):
        x = torch.randn(B, SEQ, 64, dtype=torch.float64)
        d_out = torch.randn(B, SEQ, 64, dtype=torch.float64)
        ref = LinearAttentionContextParallel(mode="p2p").apply(copy.deepcopy(base), single)
        out_ref, dx_ref = run_fwd_bwd(ref, x, d_out, **kwargs)
        g_ref = flat(grads_of(ref))
        runs = {}
        for passing in ("chain", "scan"):
            cp = LinearAttentionContextParallel(mode="p2p", state_passing=passing).apply(copy.deepcopy(base), mesh)
            out, dx = run_fwd_bwd(cp, local_slice(x, rank, world), local_slice(d_out, rank, world), **kwargs)
            runs[passing] = (out, dx, _grads_summed(cp))
        out, dx, g = runs["scan"]
        for what, got, chain, single_ref, in (("output", out, runs["chain"][0], local_slice(out_ref, rank, world)),
                                              ("input grad", dx, runs["chain"][1], local_slice(dx_ref, rank, world)),
                                              ("param grads", g, runs["chain"][2], g_ref)):
            for against, want, bound in (("chain", chain, EXACT), ("single device", single_ref, TIGHT)):
                err = rel_l2(got, want)
                if not err < bound:
                    failures.append(f"CP{world} {label} scan {what} vs {against}: {err:.3e} >= {bound:.0e}")


def _model_step(model, mesh, ids, cu):
    model.zero_grad(set_to_none=True)
    batch = shard_batch_for_cp(ids, mesh, cu_seqlens=cu)
    logits = model(**{k: v for k, v in batch.items() if k != "target_ids"}, use_cache=False).logits
    cp_cross_entropy(logits, batch["target_ids"], mesh).backward()
    all_reduce_cp_grads(model, mesh)
    return flat(grads_of(model))


def _model_checks(rank, world, failures):
    torch.manual_seed(0)
    base = long_memory_gates_(Qwen3_5ForCausalLM(tiny_config()).double())
    mesh = cp_mesh()
    ids = torch.randint(0, 256, (1, SEQ))
    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist())
    kw = dict(linear_attention_cp_mode="p2p", full_attention_cp="allgather")  # 8 attention heads do not split 5 ways
    chain = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, **kw)
    expected = _model_step(chain, mesh, ids, cu)
    single = self_meshes()
    single_grads = _model_step(parallelize_qwen3_5_cp(copy.deepcopy(base), single, **kw), single, ids, cu)
    logs = {}
    for ac in (False, True):
        model = parallelize_qwen3_5_cp(copy.deepcopy(base), mesh, linear_attention_state_passing="scan", **kw)
        if ac:
            apply_activation_checkpointing(model)
        passings = p2p_passings(model)
        for p in passings:
            p.log = []
        got = _model_step(model, mesh, ids, cu)
        logs[ac] = [list(p.log) for p in passings]
        for against, want, bound in (("chain", expected, EXACT), ("single device", single_grads, TIGHT)):
            err = rel_l2(got, want)
            if not err < bound:
                failures.append(f"CP{world} model scan (AC {ac}) grads vs {against}: {err:.3e} >= {bound:.0e}")
    if logs[False] != logs[True]:
        failures.append(f"rank {rank}: p2p messages differ under activation checkpointing:\n{logs}")
    if not logs[False][0] or not all(e.split()[1] in ("H", "dH") for e in logs[False][0]):
        failures.append(f"rank {rank}: expected scan messages only, got {logs[False][0]}")


def layer_scan_worker(rank, world):
    failures = []
    _layer_checks(rank, world, failures)
    _model_checks(rank, world, failures)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_gdn_layer_and_model_scan_cp5():
    run_distributed(layer_scan_worker, 5, timeout_s=300)
