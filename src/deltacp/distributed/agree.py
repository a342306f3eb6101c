"""Check locally, then raise on every rank together.

A check that fails on some ranks only must not leave the others waiting in the next collective until the
process-group timeout, and ranks that were handed different configurations or inputs would meet in different
collectives and hang. Every site that validates something before communicating does it in two steps:

    with LocalChecks() as checks:          # any ValueError / NotImplementedError / TypeError / RuntimeError is kept
        ...local checks...
    raise_together(group, "parallelize_cp", checks.error, agree=config)

`raise_together` is one all-gather of every rank's outcome and of the values that must agree (`agree`: name ->
value). Then a rank whose checks failed raises its own error, every other rank a RuntimeError naming the
failing ranks and the first failure's message, and when the agreed values differ every rank raises a
ValueError naming each differing field and what each rank holds. Nothing is raised when all is well.

Two transports, one outcome: with `device` given, the header travels as one int64 tensor (the per-forward input
checks: values are ints, tuples of ints or floats, a float as its exact bit pattern; a failure's messages follow in
a second, object exchange that only a failing step pays); without it, as Python objects (configurations of strings
and numbers, once per setup).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import torch
import torch.distributed as dist

CHECK_ERRORS = (ValueError, NotImplementedError, TypeError, RuntimeError)


class LocalChecks:
    """A block whose check errors are kept (`.error`) instead of raised, for `raise_together`. `also`: more
    exception types to keep (OSError where the block reads or writes files: a path missing on one rank only)."""

    def __init__(self, *also: type[BaseException]):
        self.error: BaseException | None = None
        self.kept = CHECK_ERRORS + also

    def __enter__(self) -> "LocalChecks":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, self.kept):
            self.error = exc
            return True
        return False


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _flatten(agree: Mapping) -> tuple[list[int], list[tuple[str, int, int, bool]]]:
    """The int64 header of `agree`: ints as they are, a float as its float64 bit pattern (exact, and told apart
    from every other float); spans (name, start, end, is_float) to read it back."""
    values, spans = [], []
    for name, value in agree.items():
        is_float = isinstance(value, float)
        if is_float:
            items = [struct.unpack("<q", struct.pack("<d", value))[0]]
        else:
            items = [int(x) for x in value] if isinstance(value, (tuple, list)) else [int(value)]
        spans.append((name, len(values), len(values) + len(items), is_float))
        values += items
    return values, spans


def _unflatten(row: list[int], spans) -> dict:
    out = {}
    for name, a, b, is_float in spans:
        if is_float:
            out[name] = struct.unpack("<d", struct.pack("<q", row[a]))[0]
        else:
            out[name] = tuple(row[a:b]) if b - a > 1 else row[a]
    return out


def _gather_header(header: torch.Tensor, group) -> torch.Tensor:
    """[n] int64 -> [P, n] from every rank: through host memory over gloo, on this rank's current GPU over NCCL
    (whatever device the checked inputs were on: a batch may still be on the host)."""
    if dist.get_backend(group) == "gloo":
        src = header.cpu()
    else:
        src = header if header.is_cuda else header.to(torch.device("cuda", torch.cuda.current_device()))
    parts = [torch.empty_like(src) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, src, group=group)
    return torch.stack(parts).cpu()


def raise_together(group, what: str, error: BaseException | None = None, *, agree: Mapping | None = None,
                   device: torch.device | str | None = None) -> None:
    """Exchange every rank's check outcome and `agree`; raise on every rank together (see the module docstring).

    Every rank of `group` must call this at the same point with the same keys in `agree`."""
    agree = dict(agree or {})
    P = dist.get_world_size(group)
    if device is not None:  # ints in one tensor; the messages only when some rank failed
        if torch.device(device).type == "meta":  # inputs without data (a check says so): the header needs a real one
            device = "cpu"
        values, spans = _flatten(agree)
        header = torch.tensor([int(error is not None), *values], dtype=torch.int64, device=device)
        headers = _gather_header(header, group)
        failed = headers[:, 0].nonzero().flatten().tolist()
        messages: list = [None] * P
        if failed:
            dist.all_gather_object(messages, _describe(error), group=group)
        per_rank = [_unflatten(row[1:].tolist(), spans) for row in headers]
    else:
        payloads: list = [None] * P
        dist.all_gather_object(payloads, (_describe(error), agree), group=group)
        messages = [p[0] for p in payloads]
        failed = [r for r, m in enumerate(messages) if m is not None]
        per_rank = [p[1] for p in payloads]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what}: the checks failed on rank(s) {failed} (rank {failed[0]}: {messages[failed[0]]}); "
                           f"every rank stops here")
    names = list(dict.fromkeys(name for theirs in per_rank for name in theirs))
    differing = [name for name in names if any(theirs.get(name) != per_rank[0].get(name) for theirs in per_rank)]
    if differing:
        raise ValueError(f"{what}: ranks disagree on " + "; ".join(
            f"{name} ({_by_value([theirs.get(name) for theirs in per_rank])})" for name in differing)
            + "; every rank must be given the same settings and its slice of the same batch")


def _by_value(values: list) -> str:
    """'rank 0: 5, ranks [1, 2, 3]: 6' (ranks grouped by the value they hold, first holder first)."""
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), []).append(rank)
    return ", ".join(f"rank {ranks[0]}: {value}" if len(ranks) == 1 else f"ranks {ranks}: {value}"
                     for value, ranks in groups.items())
