"""`LinearAttentionContextParallel`: the ParallelStyle that makes a transformers GDN module (Qwen3.5 dense or
MoE, Qwen3-Next: any class a model adapter registered a view for) compute its rank's slice of the
single-device output under context parallelism.

    LinearAttentionContextParallel(mode="p2p", backend="eager").apply(layer.linear_attn, cp_mesh)

After `apply`, `module(local_hidden_states)` on each rank's contiguous slice returns that slice of the
single-device output; gradients summed over ranks are the single-device gradients. Parameters stay
replicated (shard them with FSDP2 on top). Everything that can be checked is checked in `__init__` and
`apply` before the one configuration exchange, which precedes any other collective.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from deltacp.distributed.collectives import StatePassing, across_subgroup, dedicated_cp_groups, ulysses_subgroup
from deltacp.ops.gdn.backends import GDN_BACKENDS, get_gdn_backend
from deltacp.parallel.fingerprint import check_same_config_across_ranks
from deltacp.parallel.gdn_layer import GDNLayerCP, gdn_forward_cp
from deltacp.parallel.layout import linear_two_d_degree
from deltacp.parallel.views import GDNView, gdn_view_of

LinearAttentionCPMode = Literal["ulysses", "p2p", "all_gather"]
LINEAR_ATTENTION_CP_MODES: tuple[str, ...] = ("ulysses", "p2p", "all_gather")


def validate_mode_and_backend(mode: str, backend: str) -> None:
    if mode not in LINEAR_ATTENTION_CP_MODES:
        raise ValueError(f"linear_attention_cp_mode={mode!r} is not supported; expected one of "
                         f"{LINEAR_ATTENTION_CP_MODES}")
    if backend not in GDN_BACKENDS:
        raise ValueError(f"linear_attention_gdn_backend={backend!r} is not supported; expected one of {GDN_BACKENDS}")
    if mode == "all_gather" and backend == "triton":
        raise NotImplementedError("linear_attention_cp_mode='all_gather' has no triton backend (it is an eager "
                                  "comparison mode); use linear_attention_gdn_backend='eager', or mode 'p2p'/'ulysses'")


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


class LinearAttentionContextParallel(ParallelStyle):
    """ulysses_degree: None (1-D: `mode` over the whole CP group) or u dividing cp; u < cp is the 2-D layout,
    Ulysses inside groups of u consecutive CP ranks and `mode` (p2p | all_gather) across them (`layout.py`)."""

    def __init__(self, mode: LinearAttentionCPMode = "ulysses", backend: str = "eager",
                 ulysses_degree: int | None = None):
        super().__init__()
        validate_mode_and_backend(mode, backend)
        if ulysses_degree is not None and (not isinstance(ulysses_degree, int) or isinstance(ulysses_degree, bool)
                                           or ulysses_degree < 1):
            raise ValueError(f"ulysses_degree={ulysses_degree!r} is not supported: None or an integer >= 1 dividing cp")
        self.mode = mode
        self.backend = backend
        self.ulysses_degree = ulysses_degree
        self.gdn_backend = get_gdn_backend(backend)  # raises here if the backend is unavailable

    def apply(self, module: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
        """Apply in place to one GDN module (e.g. `layer.linear_attn` of any supported family) and return it."""
        return self._apply(module, cp_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = cp_group_of(device_mesh)
        config, error = {}, None
        try:
            config = self.check_module(module, group.size())
        except (ValueError, NotImplementedError, RuntimeError, TypeError) as e:
            error = e  # raised below, on every rank together
        check_same_config_across_ranks(config, group, "LinearAttentionContextParallel", error)
        return self.install(module, group, self.p2p_group(device_mesh))

    def p2p_group(self, cp_mesh: DeviceMesh):
        """The process groups `install` needs besides the CP group (after `check_module` and the configuration
        exchange; every rank calls it at the same point). 1-D: the state-hop group of p2p mode (None in the other
        modes). 2-D: a `TwoDGroups` (Ulysses group, across group, and for p2p the across state-hop group)."""
        cp = cp_group_of(cp_mesh).size()
        u = linear_two_d_degree(cp, self.ulysses_degree, self.mode)
        if u is not None:
            from deltacp.parallel.two_d import TwoDGroups

            return TwoDGroups(ulysses=ulysses_subgroup(cp_mesh, u), across=across_subgroup(cp_mesh, u),
                              across_p2p=across_subgroup(cp_mesh, u) if self.mode == "p2p" else None)
        if self.mode != "p2p":
            return None
        return dedicated_cp_groups(cp_mesh) if cp > 1 else cp_group_of(cp_mesh)

    def check_module(self, module: nn.Module | GDNView, cp: int) -> dict:
        """Validate the module (through its family's view) for this mode and return the configuration every rank
        must share."""
        view = gdn_view_of(module)
        conv = view.conv1d
        conv_dim = 2 * view.num_k_heads * view.head_k_dim + view.num_v_heads * view.head_v_dim
        if conv.stride[0] != 1 or conv.groups != conv_dim or conv.in_channels != conv.out_channels:
            raise ValueError(f"linear attention CP needs a depthwise causal conv with stride 1 and groups == "
                             f"conv_dim ({conv_dim}); got stride {conv.stride[0]}, groups {conv.groups}")
        if conv.padding[0] != (conv.kernel_size[0] - 1) * conv.dilation[0]:
            raise ValueError(f"linear attention CP needs a causal conv with padding (kernel-1)*dilation = "
                             f"{(conv.kernel_size[0] - 1) * conv.dilation[0]}, got padding {conv.padding[0]}")
        if view.num_v_heads % view.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({view.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({view.num_k_heads})")
        u = linear_two_d_degree(cp, self.ulysses_degree, self.mode)
        if u is not None and view.num_v_heads % u:
            raise ValueError(f"ulysses_degree={u} must divide linear_num_value_heads ({view.num_v_heads}): in the "
                             f"2-D layout GDN layers split their heads over each Ulysses group of {u} ranks")
        if self.mode == "ulysses":
            from deltacp.parallel.ulysses import ulysses_head_layout

            ulysses_head_layout(view.num_k_heads, view.num_v_heads, cp)
        param = view.parameter()
        return dict(mode=self.mode, backend=self.backend, cp=cp, ulysses_degree=u, family=view.family,
                    num_k_heads=view.num_k_heads, num_v_heads=view.num_v_heads, head_k_dim=view.head_k_dim,
                    head_v_dim=view.head_v_dim,
                    conv_kernel=conv.kernel_size[0], dtype=str(param.dtype), device_type=param.device.type)

    def install(self, module: nn.Module, group, p2p_group=None) -> nn.Module:
        """Install the CP forward (after `check_module` and the configuration exchange). p2p: the state hops run
        on `p2p_group` (from `p2p_group`)."""
        match self.mode:
            case "ulysses":
                from deltacp.parallel.ulysses import ulysses_mixer as mixer
            case "p2p":
                from deltacp.parallel.p2p import p2p_mixer as mixer
            case "all_gather":
                from deltacp.parallel.all_gather import all_gather_mixer as mixer
        two_d = linear_two_d_degree(group.size(), self.ulysses_degree, self.mode) is not None
        if two_d:
            from deltacp.parallel.two_d import two_d_mixer as mixer
        layer = GDNLayerCP(view=gdn_view_of(module), group=group, mode=self.mode, backend=self.gdn_backend,
                           mixer=mixer)
        if two_d:
            layer.extra["two_d"] = p2p_group
            if self.mode == "p2p":
                layer.extra["passing"] = StatePassing(p2p_group.across_p2p)
        elif self.mode == "p2p":
            if p2p_group is None:
                raise ValueError("linear_attention_cp_mode='p2p' installs with its state-hop group (p2p_group)")
            layer.extra["passing"] = StatePassing(p2p_group)
        # The instance's forward only: the class, parameters, state_dict keys and save_pretrained stay
        # transformers' own (a forward hook cannot replace a computation; see docs/design.md, adapters).
        module._deltacp_cp = layer
        module.forward = partial(gdn_forward_cp, layer)
        return module
