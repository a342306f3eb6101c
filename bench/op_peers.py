"""The driver the op benchmarks against public kernels share (bench/ssd_op.py, kda_op.py, gdn_peers.py): accuracy
against a float64 reference in several gate regimes, forward and forward + backward times with peak memory, and the
CUDA kernel time of one forward + backward, for every stack on the same inputs in one process (timing method:
bench/timing.py).

A stack is (label, fn): fn(*inputs) -> (output, final state). Ours are the labels starting with "deltacp": a
failure of ours (an exception, or a worst rel-L2 above the bound) fails the run; a public kernel that raises is
reported in its row and the run goes on.
"""

from __future__ import annotations

import torch

from timing import emit, profile_step, time_cuda


def fwd_bwd(fn, t, names, seed=1):
    """(output, final state, {name: gradient}) of fn(*t[names]) against fixed random output / state gradients."""
    y, ht = fn(*(t[n] for n in names))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gy = torch.randn(y.shape, generator=gen, device="cuda")
    gh = torch.randn(ht.shape, generator=gen, device="cuda") * 0.1
    grads = torch.autograd.grad((y.float() * gy).sum() + (ht.float() * gh).sum(), [t[n] for n in names])
    return y, ht, dict(zip(names, grads))


def timed_fwd_bwd(fn, t, names, seed=1):
    """A closure running fn(*t[names]) and its backward against gradients of the output and final state drawn once
    here (in the output's dtype), so that the timed region holds the op's forward and backward alone."""
    y, ht = fn(*(t[n] for n in names))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gy = torch.randn(y.shape, generator=gen, device="cuda").to(y.dtype)
    gh = (torch.randn(ht.shape, generator=gen, device="cuda") * 0.1).to(ht.dtype)
    leaves = [t[n] for n in names]
    del y, ht

    def step():
        y, ht = fn(*leaves)
        torch.autograd.grad((y, ht), leaves, (gy, gh))

    return step


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def ours(label: str) -> bool:
    return label.startswith("deltacp")


def compare(runs, make, reference, names, *, regimes, lengths, accuracy_length, bound, repeat=10, warmup=3,
            profile=None, json=None, tag=None, timing_regime="slow"):
    """Accuracy in every regime at `accuracy_length` (none for regimes=[]), then times at every length, then
    (profile: a length) the kernels of one fwd + bwd of each stack. `make(T, regime)` -> {name: leaf tensor requiring grad} in the dtype
    the stacks take; `reference` runs on float64 copies of them. Prints the tables; returns the failures of ours."""
    tag = tag or {}
    failed, worst = [], {}
    for regime in regimes:
        t = make(accuracy_length, regime)
        t64 = {n: x.detach().double().requires_grad_() for n, x in t.items()}
        y_ref, h_ref, g_ref = fwd_bwd(reference, t64, names)
        del t64
        for label, fn in runs:
            try:
                y, h, g = fwd_bwd(fn, t, names)
            except Exception as e:  # noqa: BLE001  (a public kernel that fails is reported; ours fails the run)
                print(f"{label} {regime}: {type(e).__name__}: {str(e)[:300]}")
                worst[(label, regime)] = float("nan")
                if ours(label):
                    failed.append(f"{label} {tag} {regime}: {type(e).__name__}")
                torch.cuda.empty_cache()
                continue
            errs = {"out": rel(y, y_ref), "h_final": rel(h, h_ref), **{f"d{n}": rel(g[n], g_ref[n]) for n in names}}
            name = max(errs, key=errs.get)
            worst[(label, regime)] = errs[name]
            emit(dict(kind="accuracy", stack=label, regime=regime, T=accuracy_length, **tag, worst=name,
                      worst_rel_l2=errs[name], **{f"rel_{k}": v for k, v in errs.items()}), json)
            if ours(label) and not errs[name] <= bound:
                failed.append(f"{label} {tag} {regime}: worst rel-L2 {errs[name]:.2e} ({name}) > {bound}")
            del y, h, g
        del t, y_ref, h_ref, g_ref
        torch.cuda.empty_cache()
    table = {}
    for T in lengths:
        for label, fn in runs:
            t = make(T, timing_regime)
            try:
                f = time_cuda(lambda: fn(*(t[n] for n in names)), warmup=warmup, repeat=repeat)  # noqa: B023
                fb = time_cuda(timed_fwd_bwd(fn, t, names), warmup=warmup, repeat=repeat)
                row = {"kind": "timing", "stack": label, "T": T, **tag, "fwd_ms": f["median_ms"],
                       "fwd_bwd_ms": fb["median_ms"], "fwd_bwd_p90_ms": fb["p90_ms"], "peak_gib": fb["peak_gib"]}
            except Exception as e:  # noqa: BLE001  (out of memory, or a public kernel that fails: in the row)
                if ours(label) and not isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                row = {"kind": "timing", "stack": label, "T": T, **tag, "error": f"{type(e).__name__}"}
            emit(row, json)
            table[(T, label)] = row
            del t
            torch.cuda.empty_cache()
    if profile:
        for label, fn in runs:
            t = make(profile, timing_regime)
            try:
                step = timed_fwd_bwd(fn, t, names)
                step()
                print(f"\n{label} {tag} T={profile}: CUDA kernel time of one fwd+bwd", flush=True)
                profile_step(step, top=12)
            except Exception as e:  # noqa: BLE001
                print(f"{label}: no profile ({type(e).__name__})")
            del t
            torch.cuda.empty_cache()
    if regimes:
        print(f"\n{tag}: worst rel-L2 vs float64 over the output, the final state and every gradient, T = "
              f"{accuracy_length} ({' / '.join(regimes)})")
        for label, _ in runs:
            print(f"  {label:>42}: " + " / ".join(f"{worst.get((label, r), float('nan')):.1e}" for r in regimes))
    print(f"{tag}: fwd ms, fwd+bwd ms, peak GiB (median of {repeat}, {timing_regime} gates)")
    print(f"{'T':>7} " + "".join(f"{label[:34]:>36}" for label, _ in runs))
    for T in lengths:
        cells = []
        for label, _ in runs:
            row = table[(T, label)]
            cells.append(f"{row['fwd_ms']:>12.2f} {row['fwd_bwd_ms']:>12.2f} {row['peak_gib']:>10.2f}"
                         if "fwd_ms" in row else f"{row['error'][:34]:>36}")
        print(f"{T:>7} " + "".join(cells), flush=True)
    return failed
