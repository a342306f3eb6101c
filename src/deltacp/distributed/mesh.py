"""The meshes and process groups of context parallelism: which ranks share a sequence, a batch, a Ulysses group.

    mesh = init_cp_mesh(cp=4)              # ("dp", "cp") over the world (dp = world // cp), on this machine's device
    cp_group_of(mesh)                      # the CP dimension's group: ranks that share one sequence
    batch_mesh_of(mesh)                    # every rank of the mesh as one dimension: ranks that share one batch

The sub-groups (a dedicated point-to-point group per CP group, the 2-D layout's Ulysses and across groups) are
created by the CP styles at install time; every rank creates them in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def default_device_type() -> str:
    """The device type of this process's ranks: 'cuda' when the default process group runs NCCL, else 'cpu'."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


def init_cp_mesh(cp: int, dp: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """A ("dp", "cp") mesh over the whole world: dp groups of cp consecutive ranks (dp = world // cp unless given).

    device_type: 'cuda' or 'cpu'; by default that of the process group's backend (NCCL: 'cuda', with each rank
    on its LOCAL_RANK device; gloo: 'cpu'), so one script runs under torchrun on GPUs and on CPU ranks alike.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_cp_mesh: no default process group; launch with torchrun (or "
                           "deltacp.distributed.launch.run_distributed on CPU) and call "
                           "torch.distributed.init_process_group first")
    world = dist.get_world_size()
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or world % cp:
        raise ValueError(f"init_cp_mesh: cp={cp!r} must be an integer >= 1 dividing the world size ({world})")
    if dp is None:
        dp = world // cp
    if dp * cp != world:
        raise ValueError(f"init_cp_mesh: dp ({dp}) x cp ({cp}) = {dp * cp} must equal the world size ({world})")
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def cp_group_of(mesh: DeviceMesh):
    """The process group of the mesh's CP dimension: a 1-D mesh, or the dimension named 'cp'."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"cp_mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if mesh.ndim == 1 and (names is None or names[0] == "cp"):
        return mesh.get_group()
    if names is None or "cp" not in names:
        raise ValueError(f"cp_mesh has no CP dimension: pass a 1-D mesh or one with a dimension named 'cp' "
                         f"(got dimension names {names} and shape {tuple(mesh.shape)})")
    for name in names:
        if name == "tp" and mesh[name].size() > 1:
            raise ValueError(f"tp={mesh[name].size()} is not supported with linear attention CP: tp must be 1")
    return mesh["cp"].get_group()


def batch_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over every rank of `mesh` (ranks that together hold one global batch): the mesh itself when
    1-D, else its dimensions flattened (e.g. ("dp", "cp") -> "dp_cp", created once and cached by torch)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    cp_group_of(mesh)  # the same checks (a CP dimension, tp 1)
    return mesh if mesh.ndim == 1 else mesh._flatten()


def batch_group_of(mesh: DeviceMesh):
    """The process group over every rank of `mesh`: dp x cp for a ("dp", "cp") mesh, the CP group for a CP mesh."""
    return batch_mesh_of(mesh).get_group()


def cp_subgroup(cp_mesh, split) -> ProcessGroup:
    """A new process group over the ranks that `split(row)` puts together with this rank, `row` being this rank's
    CP ranks in CP order (`split` partitions it into lists of global ranks). Only the members take part in
    creating a group (local synchronisation); every rank must call this in the same order."""
    names = cp_mesh.mesh_dim_names
    layout = cp_mesh.mesh
    if cp_mesh.ndim > 1:
        layout = layout.movedim(names.index("cp"), -1)
    rows = layout.reshape(-1, layout.shape[-1]).tolist()
    me = dist.get_rank()
    mine = None
    for row in rows:
        for ranks in split(row):
            if me in ranks:
                mine = dist.new_group(ranks, use_local_synchronization=True)
    if mine is None:
        raise RuntimeError(f"rank {me} is not in the CP mesh {rows}")
    return mine


def dedicated_cp_groups(cp_mesh) -> ProcessGroup:
    """A second process group over this rank's CP ranks, for point-to-point state traffic only.

    On NCCL a communicator serialises its operations: a receive posted on the communicator that also carries
    the CP collectives could hold up a collective that its sender must finish first. With the state hops on
    their own communicator, no collective ever waits behind a point-to-point operation or the reverse. Only
    the ranks of one CP group take part in creating its group (local synchronisation).
    """
    return cp_subgroup(cp_mesh, lambda row: [row])


def ulysses_subgroup(cp_mesh, degree: int) -> ProcessGroup:
    """2-D layout: this rank's Ulysses group, `degree` consecutive CP ranks (so its tokens are contiguous)."""
    return cp_subgroup(cp_mesh, lambda row: [row[i:i + degree] for i in range(0, len(row), degree)])


def across_subgroup(cp_mesh, degree: int) -> ProcessGroup:
    """2-D layout: rank j of every Ulysses group of `degree` ranks (CP ranks j, j + degree, ...), in group order.
    Each call creates a new communicator (one for collectives, one per kind of point-to-point traffic)."""
    return cp_subgroup(cp_mesh, lambda row: [row[j::degree] for j in range(degree)])
