"""The GDN backends by name: what `linear_attention_backend` selects (the contract they meet: `contract.py`).

Imports no backend: `get_gdn_backend` imports the one it is asked for, so Triton is imported only for "triton".
"""

from __future__ import annotations

from typing import Literal, get_args

from deltacp.ops.gdn.contract import GDNBackend

GDNBackendName = Literal["eager", "triton"]
GDN_BACKENDS: tuple[str, ...] = get_args(GDNBackendName)


def get_gdn_backend(name: str) -> GDNBackend:
    """The backend called `name`. Triton is imported here, and only for backend="triton"."""
    match name:
        case "eager":
            from deltacp.ops.gdn.eager import EagerGDNBackend

            return EagerGDNBackend()
        case "triton":
            from deltacp.ops.gdn.triton import TritonGDNBackend

            return TritonGDNBackend()
        case _:
            raise ValueError(f"linear_attention_backend={name!r} is not supported; expected one of {GDN_BACKENDS}")
