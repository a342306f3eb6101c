"""One case of a Triton recurrence against its eager reference on the same values (run by the interpreter tests'
subprocesses: tests/unit/test_ssd_triton_interpret.py, test_kda_triton_interpret.py): prints "FIG case dtype
quantity rel-L2" for the outputs, every gradient (autograd through both), the summary (M, S) and the entering
state's gradient from the outputs alone, for `helpers.interpreter_figures` to read."""

from __future__ import annotations

import torch

from deltacp.ops.recurrence import RecurrenceInputs


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def compare_case(name, dtype, tri, ref, vals, grad_names, seed, layout=None, strided=False) -> None:
    """vals: the recurrence's inputs, then the entering state, in float64 (an optional input may be None: no gradient named
    for it); the Triton side gets them in `dtype` (strided: as non-contiguous views of the same values), the eager
    side in float64; `seed`: the output cotangents'."""
    present = [x is not None for x in vals]
    grad_names = [n for n, p in zip(grad_names, present) if p]  # one name per input, in order
    xs = [None if x is None else x.to(dtype).requires_grad_() for x in vals]
    if strided:
        xs = [x.mT.contiguous().mT if x is not None and x.dim() == 4 else x for x in xs]
    rs = [None if x is None else x.clone().requires_grad_() for x in vals]
    o, ht = tri.forward(RecurrenceInputs(*xs[:-1]), initial_state=xs[-1], output_final_state=True,
                        cu_seqlens=layout)
    ro, rht = ref.forward(RecurrenceInputs(*rs[:-1]), initial_state=rs[-1], output_final_state=True,
                          cu_seqlens=layout)
    assert o.dtype == dtype and o.shape == ro.shape and ht.shape == rht.shape, (o.dtype, o.shape, ht.shape)
    out = {"o": rel(o, ro), "final_state": rel(ht, rht)}
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(rht.shape, generator=gen, dtype=torch.float64)
    xs_, rs_ = [x for x in xs if x is not None], [x for x in rs if x is not None]
    gs = torch.autograd.grad((o * do.to(dtype)).sum() + (ht * dht.to(ht.dtype)).sum(), xs_)
    grs = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), rs_, allow_unused=True)
    grs = [torch.zeros_like(x) if d is None else d for x, d in zip(rs_, grs)]  # h0 unused: a fresh first document
    for n, a, b in zip(grad_names, gs, grs):
        out[n] = rel(a, b) if b.norm() > 0 else a.norm().item()
    x = RecurrenceInputs(*(None if t is None else t.detach() for t in xs[:-1]))
    rx = RecurrenceInputs(*vals[:-1])
    with torch.no_grad():
        m, s = tri.summary(x, cu_seqlens=layout)
        rm, rs_ = ref.summary(rx, cu_seqlens=layout)
        assert m.shape == rm.shape and s.shape == rs_.shape, (m.shape, rm.shape, s.shape)
        # a fast-decaying M (e^-250) is below fp32's range (0 there): the absolute error then
        out["summary_M"] = rel(m, rm) if rm.norm() > 1e-20 else (m.double() - rm).norm().item()
        out["summary_S"] = rel(s, rs_)
        none, s2 = tri.summary(x, need_transition=False, cu_seqlens=layout)
        assert none is None and torch.equal(s2, s)
    dh0 = tri.initial_state_grad(x, do.to(dtype), cu_seqlens=layout)
    rdh0 = ref.initial_state_grad(rx, do, cu_seqlens=layout)
    out["initial_state_grad"] = rel(dh0, rdh0) if rdh0.norm() > 0 else dh0.norm().item()
    for n, v in out.items():
        print("FIG", name, str(dtype).split(".")[1], n, repr(v))
