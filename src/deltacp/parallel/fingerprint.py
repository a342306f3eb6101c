"""One small exchange that proves every rank applies the same CP configuration.

Ranks that disagree (mode, backend, degrees, layer shapes, dtypes) would otherwise meet in different
collectives and hang; here every rank sees every other rank's configuration and all raise together.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup


def check_same_config_across_ranks(config: dict, group: ProcessGroup, what: str,
                                   error: BaseException | None = None) -> None:
    """Exchange every rank's configuration and the outcome of its local checks; raise on every rank together.

    Validate, then exchange: a rank whose checks raised passes `error` instead of raising it at once (its peers
    would otherwise wait in this exchange until the process-group timeout). Then the failing ranks raise their
    own error and every other rank a RuntimeError naming the failing rank and its message.
    """
    payload = dict(config=config, error=None if error is None else f"{type(error).__name__}: {error}")
    gathered_payloads: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered_payloads, payload, group=group)
    mine = dist.get_rank(group)
    failed = [(rank, p["error"]) for rank, p in enumerate(gathered_payloads) if p["error"] is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"{what}: the checks failed on rank(s) {[r for r, _ in failed]} (rank {rank}: {message}); "
                           f"every rank stops here")
    gathered = [p["config"] for p in gathered_payloads]
    for rank, theirs in enumerate(gathered):
        if theirs != config:
            diff = {key: (config.get(key), theirs.get(key)) for key in sorted(set(config) | set(theirs))
                    if config.get(key) != theirs.get(key)}
            raise RuntimeError(
                f"{what}: ranks disagree on the CP configuration (rank {mine} vs rank {rank}: "
                + ", ".join(f"{key}={a!r} vs {b!r}" for key, (a, b) in diff.items())
                + "); every rank must apply the same mode, backend, degrees and model")
