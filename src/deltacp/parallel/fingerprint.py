"""One small exchange that proves every rank applies the same CP configuration.

Ranks that disagree (mode, backend, degrees, layer shapes, dtypes) would otherwise meet in different
collectives and hang; here every rank sees every other rank's configuration and all raise together.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup


def check_same_config_across_ranks(config: dict, group: ProcessGroup, what: str) -> None:
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, config, group=group)
    mine = dist.get_rank(group)
    for rank, theirs in enumerate(gathered):
        if theirs != config:
            diff = {key: (config.get(key), theirs.get(key)) for key in sorted(set(config) | set(theirs))
                    if config.get(key) != theirs.get(key)}
            raise RuntimeError(
                f"{what}: ranks disagree on the CP configuration (rank {mine} vs rank {rank}: "
                + ", ".join(f"{key}={a!r} vs {b!r}" for key, (a, b) in diff.items())
                + "); every rank must apply the same mode, backend, degrees and model")
