"""GDN layers under sequence_layout='balanced' (rank r holds pieces r and 2P - 1 - r of the row) on gloo, float64,
against deltacp's single-device computation (the same module on a one-rank mesh) at 1e-8.

One spawn per world size (2, 4, 8) runs every case: every mode (ulysses, p2p with the chain and with the scan,
all_gather) in the 1-D layout and, from 4 ranks, p2p / all_gather across groups in the 2-D layout (u = 2); each
unpacked (B = 2) and packed (B = 1, documents crossing pieces, a piece whose first document starts at its first
token, pieces with several document starts). Checked: each rank's output and input gradient (its two pieces,
cut here independently of deltacp: `helpers.local_slice`), every parameter gradient summed over ranks. Plus the
p2p message logs: the chain runs 2P - 1 hops through every piece in row order, the scan ceil(log2 2P) rounds.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from deltacp import LinearAttentionContextParallel, all_reduce_cp_grads, cp_layer_of
from deltacp.distributed.launch import run_distributed
from helpers import (cp_mesh, flat, grads_of, local_slice, long_memory_gates_, rel_l2, run_fwd_bwd, self_meshes,
                     tiny_config)

TIGHT = 1e-8
S = 256  # pieces of 64 / 32 / 16 tokens at CP 2 / 4 / 8 (the conv halo is 3)
# lengths 3, 37, 1, 59, 60, 1, 69, 26: at CP8 (pieces of 16) a document starts at piece 10's first token (160),
# pieces 0, 2, 6, 14 hold starts inside, the long documents cross several pieces and both ranks' halves
PACKED = [0, 3, 40, 41, 100, 160, 161, 230, 256]


def _cases(world):
    cases = [("ulysses", None, "chain"), ("p2p", None, "chain"), ("p2p", None, "scan"), ("all_gather", None, "chain")]
    if world >= 4:
        cases += [("p2p", 2, "chain"), ("p2p", 2, "scan"), ("all_gather", 2, "chain")]
    return cases


def balanced_gdn_worker(rank, world):
    failures = []
    torch.manual_seed(1)
    base = long_memory_gates_(Qwen3_5GatedDeltaNet(tiny_config(), 0).double())  # Hk 4, Hv 8
    mesh, single = cp_mesh(), self_meshes()
    for label, B, kwargs in (("unpacked", 2, {}), ("packed", 1, {"cu_seq_lens_q": torch.tensor(PACKED)})):
        x = torch.randn(B, S, 64, dtype=torch.float64)
        d_out = torch.randn(B, S, 64, dtype=torch.float64)
        refs = {}
        for mode, u, passing in _cases(world):
            if mode not in refs:
                ref = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(base), single)
                out_ref, dx_ref = run_fwd_bwd(ref, x, d_out, **kwargs)
                refs[mode] = (out_ref, dx_ref, flat(grads_of(ref)))
            out_ref, dx_ref, g_ref = refs[mode]
            cp = LinearAttentionContextParallel(mode=mode, ulysses_degree=u, state_passing=passing,
                                                sequence_layout="balanced").apply(copy.deepcopy(base), mesh)
            layer = cp_layer_of(cp)
            if layer.passing is not None:
                layer.passing.log = []
            out, dx = run_fwd_bwd(cp, local_slice(x, rank, world, layout="balanced"),
                           local_slice(d_out, rank, world, layout="balanced"), **kwargs)
            all_reduce_cp_grads(cp, mesh)
            tag = f"CP{world} {mode} u={u} {passing} {label}"
            for what, got, want in (
                    ("output", out, local_slice(out_ref, rank, world, layout="balanced")),
                    ("input grad", dx, local_slice(dx_ref, rank, world, layout="balanced")),
                    ("param grads", flat(grads_of(cp)), g_ref)):
                err = rel_l2(got, want)
                if not err < TIGHT:
                    failures.append(f"{tag} {what}: {err:.3e}")
            if mode == "p2p" and u is None and label == "unpacked":
                _check_messages(layer.passing.log, rank, world, passing, tag, failures)
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _check_messages(log, rank, world, passing, tag, failures):
    """The chain: forward, rank r receives H_in for piece r from r - 1 and for piece 2P - 1 - r from r + 1 (the last
    rank hands its first piece's state to its second locally); the scan: ceil(log2 2P) rounds."""
    forward = [e for e in log if " H" in e]
    if passing == "chain":
        expected = []
        if rank > 0:
            expected.append(f"recv H_in <-{rank - 1}")
        if rank < world - 1:
            expected += [f"send H_out ->{rank + 1}", f"recv H_in <-{rank + 1}"]
        if rank > 0:
            expected.append(f"send H_out ->{rank - 1}")
        if forward != expected:
            failures.append(f"{tag}: forward messages {forward}, expected {expected}")
    else:
        rounds = {e.split()[2] for e in forward}
        want = (2 * world - 1).bit_length()
        if len(rounds) > want:
            failures.append(f"{tag}: {len(rounds)} scan rounds, expected at most {want}: {forward}")


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.fast), 4, 8])
def test_balanced_gdn_layer_parity(world):
    run_distributed(balanced_gdn_worker, world, timeout_s=900)
