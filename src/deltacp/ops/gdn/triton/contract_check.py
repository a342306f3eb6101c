"""`check_triton_contract`: what the Triton GDN backend accepts (docs/design.md section 5). Imports no Triton kernel
(but for the first-use self-check of an unverified Triton version, `selfcheck.py`). The accepted Triton versions
are `version.py`'s.

Never falls back: anything outside the contract raises with the setting's name and the allowed values.
"""

from __future__ import annotations

import torch

from deltacp.ops.fused import device_error
from deltacp.ops.gdn.triton.version import (
    TRITON_VERIFIED_ON_GPU, TRITON_VERSION_RANGE, _fmt, _triton_version, parse_triton_version, triton_requirement)

# head_k_dim and head_v_dim each, in any combination (K != V too: OLMo-Hybrid's K = 96, V = 192). Dims that are not
# powers of two run on tiles of the next power of two with the extra columns masked (indexing.py).
HEAD_DIMS = (64, 96, 128, 192, 256)


def check_triton_version(version: str | None = None, device: torch.device | str | None = None) -> None:
    """Refuse a Triton outside TRITON_VERSION_RANGE; accept a verified one; any other one only once the first-use
    self-check (`selfcheck.py`) has passed on `device` (cached per Triton version, GPU model, deltacp version).
    device None: the range is checked, the self-check is not (nothing to run it on)."""
    version = _triton_version() if version is None else version
    major_minor = parse_triton_version(version)
    lo, hi = TRITON_VERSION_RANGE
    verified = ", ".join(_fmt(v) for v in TRITON_VERIFIED_ON_GPU)
    if not (lo <= major_minor < hi):
        raise RuntimeError(f"triton=={version} is outside the range the Triton GDN kernels accept "
                           f"({triton_requirement()}; verified on a GPU: {verified}; any other version in the "
                           f"range after a first-use self-check); install one with pip install "
                           f"\"deltacp[triton]\" or use backend='eager'")
    if major_minor in TRITON_VERIFIED_ON_GPU or device is None:
        return
    from deltacp.ops.gdn.triton.selfcheck import run_self_check

    run_self_check(device, triton_version=version)


def check_triton_contract(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          *, triton_version: str | None = None) -> None:
    """Raise ValueError/RuntimeError naming the offending setting if the inputs are outside the contract."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device.type != "cuda":
            raise device_error(name, x)
    for name, x, want in (("q", q, torch.bfloat16), ("k", k, torch.bfloat16), ("v", v, torch.bfloat16),
                          ("beta", beta, torch.bfloat16), ("g", g, torch.float32)):
        if x.dtype != want:
            raise ValueError(f"backend='triton' needs {name}.dtype={want}; got {x.dtype}")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or g.dim() != 3 or beta.shape != g.shape:
        raise ValueError(f"backend='triton' needs q, k [B,T,Hk,K], v [B,T,Hv,V], g, beta [B,T,Hv]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}")
    B, T, Hk, K = q.shape
    if v.shape[:2] != (B, T) or g.shape != v.shape[:3]:
        raise ValueError(f"backend='triton': v {tuple(v.shape)} and g {tuple(g.shape)} must share B, T (and Hv)")
    Hv, V = v.shape[2], v.shape[3]
    for name, dim in (("head_k_dim", K), ("head_v_dim", V)):
        if dim not in HEAD_DIMS:
            raise ValueError(f"backend='triton' supports {name} in {HEAD_DIMS} (head_k_dim and head_v_dim may "
                             f"differ); got head_k_dim={K}, head_v_dim={V}")
    if Hv % Hk != 0:
        raise ValueError(f"backend='triton' needs value heads divisible by key heads; got Hv={Hv}, Hk={Hk}")
    # No length condition: the op pads every sequence (and lays packed documents out) to whole chunks itself.
    check_triton_version(triton_version, q.device)
