"""The CP layout: 1-D (every layer over the whole CP group) or 2-D (`ulysses_degree` = u < cp).

2-D: the cp ranks of a CP group form cp / u groups of u consecutive ranks (group g = CP ranks g u .. g u + u - 1,
so its tokens are one contiguous slice of the row). Every layer runs Ulysses inside its group (heads split u
ways) and a sequence algorithm across groups, between rank j of each group (CP ranks j, j + u, ...):

    layer            inside a group     across groups
    linear           Ulysses            linear_attention_cp_mode: a mode that runs across groups (p2p | all_gather)
    full attention   Ulysses            full_attention_cp: a method that runs across groups (all_gather | ring)

ulysses_degree None or cp is the 1-D layout: linear-recurrent layers by linear_attention_cp_mode and full attention by
full_attention_cp, each over the whole CP group (a method that splits heads needs the attention heads to divide
by cp; the others have no head limit). ulysses_degree = 1 is the 1-D layout of the across-group methods (groups
of one rank). Which mode may run where is the registry's (`modes.py`). Every check here runs before any
collective.
"""

from __future__ import annotations

from deltacp.parallel.modes import ATTENTION_METHODS, LINEAR_MODES, attention_method, linear_mode


def check_ulysses_degree_value(ulysses_degree, prefix: str = "") -> None:
    """None or an integer >= 1 (what can be checked before cp is known)."""
    if ulysses_degree is not None and (not isinstance(ulysses_degree, int) or isinstance(ulysses_degree, bool)
                                       or ulysses_degree < 1):
        raise ValueError(f"{prefix}ulysses_degree={ulysses_degree!r} is not supported: "
                         f"{'null' if prefix else 'None'} or an integer >= 1 dividing cp")


def check_ulysses_degree(cp: int, ulysses_degree, prefix: str = "") -> None:
    if ulysses_degree is None:
        return
    divisors = [d for d in range(1, cp + 1) if cp % d == 0]
    if not isinstance(ulysses_degree, int) or isinstance(ulysses_degree, bool) or ulysses_degree not in divisors:
        raise ValueError(f"{prefix}ulysses_degree={ulysses_degree!r} is not supported at cp={cp}: it must be "
                         f"{'null' if prefix else 'None'} or a divisor of cp, one of {divisors}")


def is_two_d(cp: int, ulysses_degree) -> bool:
    """Whether the layers run across groups (ulysses_degree < cp; u = 1: groups of one rank)."""
    return ulysses_degree is not None and ulysses_degree < cp


def linear_two_d_degree(cp: int, ulysses_degree, mode: str, prefix: str = "") -> int | None:
    """u for a 2-D linear-recurrent layer (1 < u < cp), None for the 1-D modes; raises naming the settings."""
    check_ulysses_degree(cp, ulysses_degree, prefix)
    resolved = linear_mode(mode, prefix=prefix)
    if not is_two_d(cp, ulysses_degree):
        return None
    if resolved.across is None:
        raise ValueError(f"{prefix}linear_attention_cp_mode={mode!r} with {prefix}ulysses_degree={ulysses_degree} < "
                         f"cp ({cp}): in the 2-D layout the mode names the across-group method, one of "
                         f"{tuple(m.name for m in LINEAR_MODES.values() if m.across is not None)} (Ulysses runs inside "
                         f"each group of ulysses_degree ranks)")
    return ulysses_degree if ulysses_degree > 1 else None


def attention_two_d_degree(cp: int, ulysses_degree, full_attention_cp: str, prefix: str = "") -> int:
    """The Ulysses degree of full attention (1: none), after checking the settings; a method that splits heads over
    the CP group returns cp."""
    method = attention_method(full_attention_cp, prefix)
    check_ulysses_degree(cp, ulysses_degree, prefix)
    if not method.across_groups:
        if is_two_d(cp, ulysses_degree):
            raise ValueError(f"{prefix}full_attention_cp={full_attention_cp!r} with {prefix}ulysses_degree="
                             f"{ulysses_degree} < cp ({cp}): in the 2-D layout full_attention_cp names the across-group "
                             f"method, one of {tuple(m.name for m in ATTENTION_METHODS.values() if m.across_groups)}")
        return cp
    return ulysses_degree if is_two_d(cp, ulysses_degree) else 1


def validate_cp_layout(cp: int, ulysses_degree, linear_attention_cp_mode: str, full_attention_cp: str,
                       prefix: str = "") -> None:
    """Every layout rule that needs no model (the trainer's config check and parallelize_cp's)."""
    linear_two_d_degree(cp, ulysses_degree, linear_attention_cp_mode, prefix)
    attention_two_d_degree(cp, ulysses_degree, full_attention_cp, prefix)
