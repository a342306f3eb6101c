"""`check_triton_contract`: what the Triton GDN backend accepts (SPEC section 5). Imports no Triton kernel.

Never falls back: anything outside the contract raises with the setting's name and the allowed values.
"""

from __future__ import annotations

import torch

# Triton versions the kernels were verified on (tests/gpu/test_triton_gdn.py on an H200): [min, max).
TRITON_VERSION_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((3, 6), (3, 7))
HEAD_DIM = 128
MODES: tuple[str, ...] = ("ulysses", "p2p")


def _triton_version() -> str:
    try:
        import triton
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("linear_attention_gdn_backend='triton' needs the `triton` package, which is not "
                           "installed; use backend='eager'") from e
    return triton.__version__


def check_triton_version(version: str | None = None) -> None:
    version = _triton_version() if version is None else version
    try:
        major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError as e:
        raise RuntimeError(f"cannot parse triton version {version!r}") from e
    lo, hi = TRITON_VERSION_RANGE
    if not (lo <= major_minor < hi):
        raise RuntimeError(f"triton=={version} is outside the range the Triton GDN kernels were tested on "
                           f"(>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}); use backend='eager' or run "
                           f"tests/gpu/test_triton_gdn.py on this version and widen TRITON_VERSION_RANGE")


def check_triton_contract(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          *, mode: str, triton_version: str | None = None) -> None:
    """Raise ValueError/RuntimeError naming the offending setting if the inputs are outside the contract."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported by backend='triton'; expected one of {MODES}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device.type != "cuda":
            raise RuntimeError(f"backend='triton' needs CUDA tensors; got {name} on device {str(x.device)!r}")
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
    if K != HEAD_DIM or V != HEAD_DIM:
        raise ValueError(f"backend='triton' supports head_k_dim = head_v_dim = {HEAD_DIM} only; got "
                         f"head_k_dim={K}, head_v_dim={V}")
    if Hv % Hk != 0:
        raise ValueError(f"backend='triton' needs value heads divisible by key heads; got Hv={Hv}, Hk={Hk}")
    # No length condition: the op pads every sequence (and lays packed documents out) to whole chunks itself.
    check_triton_version(triton_version)
