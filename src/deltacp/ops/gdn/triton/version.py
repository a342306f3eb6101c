"""Which Triton the GDN kernels accept: the verified versions, the accepted range, and the installed version.
Imports triton only inside `_triton_version`. The check that enforces them is `contract_check.check_triton_version`
(which runs `selfcheck.py` for a version in the range that was not verified on a GPU).
"""

from __future__ import annotations

# Triton versions (major.minor) the kernels were verified on, on a GPU: tests/gpu/test_triton_gdn.py,
# test_triton_varlen.py, test_cp_triton.py and bench/determinism.py on an H200. These are accepted at once.
TRITON_VERIFIED_ON_GPU: tuple[tuple[int, int], ...] = ((3, 6),)
# Every Triton in [min, max) is accepted: a verified one at once, any other only after `selfcheck.py` passed on
# this GPU model (first use, verdict cached). 3.6 is the oldest the kernels run on; torch up to 2.15 ships
# Triton up to 3.9. The bound is the next major release: minor releases keep the `tl` language our kernels use
# (tl.dot input_precision, do_not_specialize, constexpr launch tables), a major one may change it, and a
# small-shape numerical check cannot vouch for a new language (races and launch configurations only show
# at scale). pyproject's `triton` extra says the same range (tests/unit/test_triton_contract.py holds them equal).
TRITON_VERSION_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((3, 6), (4, 0))


def _fmt(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def triton_requirement() -> str:
    """The accepted range as a pip specifier, e.g. ">=3.6,<4" (what pyproject's `triton` extra says)."""
    lo, hi = TRITON_VERSION_RANGE
    return f">={_fmt(lo)},<{hi[0]}" if hi[1] == 0 else f">={_fmt(lo)},<{_fmt(hi)}"


def _triton_version() -> str:
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(f"linear_attention_backend='triton' needs the `triton` package "
                           f"({triton_requirement()}), which is not installed; pip install \"deltacp[triton]\" "
                           f"or use backend='eager'") from e
    return triton.__version__


def parse_triton_version(version: str) -> tuple[int, int]:
    try:
        return tuple(int(x) for x in version.split("+")[0].split(".")[:2])  # type: ignore[return-value]
    except ValueError as e:
        raise RuntimeError(f"cannot parse triton version {version!r}") from e
