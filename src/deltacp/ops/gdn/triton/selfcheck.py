"""First-use self-check of the Triton GDN kernels under a Triton version that was not verified on a GPU.

`check_triton_version` accepts a Triton in TRITON_VERIFIED_ON_GPU at once, and any other one in
TRITON_VERSION_RANGE only once `run_self_check` has passed on this device model. The check runs every operation
of the backend at a small shape on the device and compares it with the eager backend in float64 on the CPU (an
independent reference) on the same values:

    fwd+bwd             chunk_gated_delta_rule with an entering state, the final state and the q/k l2 norm:
                        o, final state and the six gradients (dq, dk, dv, dg, dbeta, dh0)
    initial_state_grad  dH0 from dO alone (p2p's dH_in before dH_out arrives)
    state_summary       M and S (slow gates, small beta: M is O(1), not a vanishing product)
    staged              p2p's path: prepare_chunks, then state_summary, the output pass (fwd+bwd) and
                        initial_state_grad (prepared_from_saved) from the prepared chunks

each for one sequence (cu_seqlens=None) and for one packed row (documents of 37, 1 and 42 tokens: not aligned to
the chunk, one of length 1; M must then be exactly 0), at each of SHAPES: B=1, T=80 (two chunks, the second
partial), Hk=1, Hv=2 (grouped heads), head dims K=V=128 and K=96, V=192 (OLMo-Hybrid's: neither a power of two, so
the masked tiles run, and K != V); bf16 q/k/v/beta and an fp32 gate, as in a model. Figure names start with the
shape ("K=96 V=192 packed o rel-L2").

Bounds (rel-L2 = ||x - ref|| / ||ref||, per quantity; a NaN fails): BOUND_BF16 for what passes through bf16
(outputs, states, gradients), BOUND_FP32 for M (an fp32 recurrence). Measured worst figures: see the constants.
A wrong kernel is off by far more: the output kernel's result scaled by 1.25 gives 0.23 on o
(tests/unit/test_triton_selfcheck.py), Triton 3.9's interpreter, whose bf16 dot multiplies raw bits, 1e11.
This check guards against a Triton that computes wrong numbers; errors below the bounds (a lost bf16 low half),
races and launch configurations that misbehave only at scale are the GPU tests' and bench/determinism.py's job.

Verdict cache: one JSON file per (Triton version, device name, deltacp version) in `cache_dir()`:
$DELTACP_CACHE_DIR, else $XDG_CACHE_HOME/deltacp, else ~/.cache/deltacp. A cached pass is accepted; a cached
failure refuses again (delete the file to re-run). The deltacp version carries a digest of the Triton backend's
sources: an editable install keeps its version number while the kernels change. An exception inside the check
(a Triton that cannot compile a kernel) refuses too, and is not cached.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from deltacp.ops.gdn.triton.version import TRITON_VERIFIED_ON_GPU, _fmt, _triton_version, triton_requirement

# Worst figures measured at K=V=128: H200, Triton 3.6 (tests/gpu/test_triton_selfcheck_gpu.py): 4.6e-3 (dg), M 1.0e-4;
# CPU interpreter, Triton 3.9 (bf16 dot widened to fp32, tests/unit/test_triton_selfcheck.py): 1.6e-2 (o), M 3.1e-4.
# At K=96, V=192, interpreter, Triton 3.9: 1.6e-2 (dq), M 3.6e-4 (tests/unit/test_triton_head_dims.py prints them).
BOUND_BF16 = 3e-2
BOUND_FP32 = 3e-3
CACHE_ENV = "DELTACP_CACHE_DIR"


class TritonSelfCheckError(RuntimeError):
    """The Triton GDN kernels failed their first-use self-check under this Triton version (never falls back)."""


@dataclass(frozen=True)
class SelfCheckShape:
    docs: tuple[int, ...] = (37, 1, 42)  # the packed case's documents; the unpacked case is one row of sum(docs)
    Hk: int = 1
    Hv: int = 2
    K: int = 128
    V: int = 128

    @property
    def T(self) -> int:
        return sum(self.docs)


SHAPES = (SelfCheckShape(), SelfCheckShape(K=96, V=192))


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.value <= self.bound  # False for NaN

    def __str__(self) -> str:
        return f"{self.name} = {self.value:.2e} (bound {self.bound:.1e})"


# ---- cache ---------------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "deltacp"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')})"


@functools.lru_cache(maxsize=1)
def deltacp_version() -> str:
    """Package version + digest of the Triton backend's and the packed layout's sources."""
    try:
        version = importlib.metadata.version("deltacp")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(here.glob("*.py")) + [here.parent / "varlen.py"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{version}+src.{digest.hexdigest()[:12]}"


def cache_key(device: torch.device | str, triton_version: str) -> dict[str, str]:
    return {"triton": triton_version, "device": device_name(device), "deltacp": deltacp_version()}


def cache_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"triton-selfcheck-{digest}.json"


def _read_verdict(path: Path, key: dict[str, str]) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key and isinstance(record.get("passed"), bool) else None


def _write_verdict(path: Path, record: dict) -> None:
    """Atomically (ranks of one job may check at once); an unwritable cache only costs a re-check next run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        import warnings

        warnings.warn(f"deltacp: could not cache the Triton self-check verdict in {path}: {e}", stacklevel=3)


# ---- the check -------------------------------------------------------------------------------------------------

def _inputs(shape: SelfCheckShape, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    T, Hk, Hv, K, V = shape.T, shape.Hk, shape.Hv, shape.K, shape.V

    def randn(*s):
        return torch.randn(*s, generator=gen)

    bf = torch.bfloat16
    g = -torch.rand(1, T, Hv, generator=gen) * 0.2
    beta = torch.rand(1, T, Hv, generator=gen).to(bf)
    return {"q": randn(1, T, Hk, K).to(bf), "k": randn(1, T, Hk, K).to(bf), "v": randn(1, T, Hv, V).to(bf),
            "g": g, "beta": beta, "h0": randn(1, Hv, K, V) * 0.3,
            "do": randn(1, T, Hv, V).to(bf), "dht": randn(1, Hv, K, V),
            # the summary's inputs: slow gates and small beta, so that M stays O(1) over T tokens
            "g_slow": g * 0.05, "beta_slow": (beta.float() * 0.1).to(bf)}


GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _run_ops(be, x: dict[str, torch.Tensor], cu, staged: bool) -> dict[str, torch.Tensor]:
    """Every operation of backend `be` on inputs x -> {quantity: tensor}. staged: p2p's path (prepare_chunks
    shared by the summary, the output pass and the dH_in pass)."""
    q, k, v, g, beta, h0, do = (x[n] for n in ("q", "k", "v", "g", "beta", "h0", "do"))
    kw = {"use_qk_l2norm_in_kernel": True, "cu_seqlens": cu}
    prep = (lambda gg, bb: be.prepare_chunks(k, v, gg, bb, **kw)) if staged else (lambda gg, bb: None)
    out = {}
    with torch.no_grad():
        out["M"], out["S"] = be.state_summary(k, v, x["g_slow"], x["beta_slow"], prepared=prep(x["g_slow"],
                                                                                                 x["beta_slow"]), **kw)
    prepared = prep(g, beta)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, ht = be.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                      prepared=prepared, **kw)
    loss = (o * do.to(o.dtype)).sum() + (ht * x["dht"].to(ht.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    out["o"], out["final_state"] = o.detach(), ht.detach()
    out.update({n: torch.zeros_like(t) if d is None else d for n, d, t in zip(GRADS, grads, leaves)})
    saved = None if prepared is None else be.prepared_from_saved(prepared.tensors_for_backward())
    out["dH0 from dO"] = be.initial_state_grad(q, k, v, g, beta, do, prepared=saved, **kw)
    return out


def _figure(name: str, got: torch.Tensor, ref: torch.Tensor, bound: float) -> Figure:
    got, ref = got.detach().double().cpu(), ref.detach().double()
    if got.shape != ref.shape:
        return Figure(f"{name} shape {tuple(got.shape)} != {tuple(ref.shape)}", float("inf"), 0.0)
    if torch.count_nonzero(ref) == 0:  # M of a packed row: exactly zero
        return Figure(f"{name} max |x| (must be 0)", got.abs().max().item(), 0.0)
    return Figure(f"{name} rel-L2", ((got - ref).norm() / ref.norm()).item(), bound)


def _triton_ops() -> SimpleNamespace:
    """The Triton backend's operations as its methods run them (`chunk.py`; `TritonGDNBackend` only forwards to
    these). Not the backend object itself: its `check` is what runs this self-check."""
    from deltacp.ops.gdn.triton import chunk

    return SimpleNamespace(chunk_gated_delta_rule=chunk.chunk_gated_delta_rule, prepare_chunks=chunk.prepare_chunks,
                           state_summary=chunk.state_summary, initial_state_grad=chunk.initial_state_grad,
                           prepared_from_saved=chunk.PreparedChunks.from_saved)


def measure(device: torch.device | str, shapes: tuple[SelfCheckShape, ...] = SHAPES) -> list[Figure]:
    """Run the Triton backend's operations on `device` at each shape and return every figure with its bound (no
    verdict), named "K=.. V=.. <case> <quantity> ..."."""
    return [Figure(f"K={s.K} V={s.V} {f.name}", f.value, f.bound) for s in shapes for f in measure_shape(device, s)]


def measure_shape(device: torch.device | str, shape: SelfCheckShape, *, dtype: torch.dtype = torch.bfloat16,
                  cases: tuple[str, ...] = ("unpacked", "packed"), staged: tuple[bool, ...] = (False, True)
                  ) -> list[Figure]:
    """The figures of one shape (the self-check runs every case, staged and not). dtype: of q/k/v/beta on `device`
    (float32: the same bf16 values, so that the kernels compute in fp32 end to end; for tests, which then hold
    the figures to their own bound, the bounds recorded here staying the bf16 ones)."""
    from deltacp.ops.gdn.eager import EagerGDNBackend

    device = torch.device(device)
    x = _inputs(shape)
    ref_x = {n: t.double() for n, t in x.items()}
    dev_x = {n: t.to(device, dtype if t.dtype == torch.bfloat16 else t.dtype) for n, t in x.items()}
    cu = torch.tensor((0, *shape.docs)).cumsum(0).to(torch.int32)
    figures = []
    for case in cases:
        case_cu = {"unpacked": None, "packed": cu}[case]
        ref = _run_ops(EagerGDNBackend(), ref_x, case_cu, staged=False)
        for st in staged:
            ours = _run_ops(_triton_ops(), dev_x, None if case_cu is None else case_cu.to(device), st)
            tag = f"{case}{' staged' if st else ''}"
            figures += [_figure(f"{tag} {n}", ours[n], ref[n], BOUND_FP32 if n == "M" else BOUND_BF16)
                        for n in ref]
    return figures


def _refusal(record: dict, path: Path, cached: bool) -> TritonSelfCheckError:
    key = record["key"]
    failed = "; ".join(f["name"] + f" = {f['value']:.2e} > bound {f['bound']:.1e}"
                       for f in record["figures"] if not f["value"] <= f["bound"])
    verified = ", ".join(_fmt(v) for v in TRITON_VERIFIED_ON_GPU)
    return TritonSelfCheckError(
        f"triton=={key['triton']} failed deltacp's self-check of the Triton GDN kernels on {key['device']} "
        f"(verified on a GPU: Triton {verified}; any other version in {triton_requirement()} must pass this check "
        f"first): {failed}. backend='triton' refuses to run and does not fall back to eager: install a verified "
        f"Triton or select linear_attention_backend='eager'. "
        f"{'Cached verdict' if cached else 'Verdict cached'} in {path}; delete it to re-run the check.")


_VERDICTS: dict[tuple[str, str], dict] = {}  # (triton version, device) -> passed record, this process


def run_self_check(device: torch.device | str = "cuda", *, triton_version: str | None = None,
                   shapes: tuple[SelfCheckShape, ...] = SHAPES, use_cache: bool = True) -> dict:
    """The verdict record of the self-check of the installed Triton on `device` (a CUDA device; "cpu" needs
    TRITON_INTERPRET=1 set before the kernels are imported). Returns it if the check passed (from this process,
    the cache file or a fresh run); raises TritonSelfCheckError naming the version, the failed figures and
    their bounds if it failed. use_cache=False: neither reads nor writes a verdict."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton self-check runs on a CUDA device, or on the CPU under TRITON_INTERPRET=1; "
                         f"got device {str(device)!r} without TRITON_INTERPRET=1")
    version = _triton_version() if triton_version is None else triton_version
    if use_cache and (version, str(device)) in _VERDICTS:
        return _VERDICTS[(version, str(device))]
    key = cache_key(device, version)
    path = cache_path(key)
    record = _read_verdict(path, key) if use_cache else None
    if record is None:
        start = time.perf_counter()
        try:
            with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False), \
                    (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
                figures = measure(device, shapes)
        except Exception as e:
            raise TritonSelfCheckError(
                f"triton=={version} failed deltacp's self-check of the Triton GDN kernels on {key['device']}: "
                f"{type(e).__name__}: {e}. backend='triton' refuses to run and does not fall back to eager "
                f"(not cached: the next run checks again)") from e
        record = {"key": key, "passed": all(f.ok for f in figures), "figures": [asdict(f) for f in figures],
                  "shapes": [asdict(s) for s in shapes], "seconds": round(time.perf_counter() - start, 2),
                  "checked": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        record = json.loads(json.dumps(record))  # as the cache file will give it back (lists, not tuples)
        if use_cache:
            _write_verdict(path, record)
        cached = False
    else:
        cached = True
    if not record["passed"]:
        raise _refusal(record, path, cached)
    if use_cache:
        _VERDICTS[(version, str(device))] = record
    return record
