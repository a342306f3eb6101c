"""The CP styles: how one layer of a linear-recurrent hybrid computes its rank's slice of the single-device output.

    LinearAttentionContextParallel(mode="p2p", backend="eager").apply(layer.linear_attn, cp_mesh)
    FullAttentionContextParallel(method="ring").apply(layer.self_attn, cp_mesh)

After `apply`, `module(local_hidden_states, ...)` on each rank's contiguous slice returns that slice of the
single-device output; gradients summed over ranks are the single-device gradients. Parameters stay replicated
(shard them with FSDP2 on top). Each style applies in three steps, which `parallelize_cp` runs over a whole model
(every layer's checks first, one exchange, then the groups once and every install):

    check_module(module, cp) -> the configuration every rank must share (raises naming the setting)
    groups(cp_mesh)          -> the process groups the layer needs besides the CP group (collective: every rank,
                                one point)
    install(module, cp_group, groups)

Only the instance's forward is replaced: the class, parameters, state_dict keys and `save_pretrained` stay
transformers' own. `cp_layer_of(module)` returns what a CP'd linear mixer runs with (its mode, groups, state hops).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from deltacp.distributed.agree import LocalChecks, raise_together
from deltacp.distributed.collectives import StatePassing
from deltacp.distributed.mesh import across_subgroup, cp_group_of, dedicated_cp_groups, ulysses_subgroup
from deltacp.ops.gdn.backends import get_gdn_backend
from deltacp.parallel.attention import (
    attention_cp_plan,
    check_attention_module,
    install_kv_cp_attention,
    install_ulysses_attention,
)
from deltacp.parallel.indexed_attention import check_indexed_attention, install_indexed_attention
from deltacp.parallel.linear_layer import LinearLayerCP, linear_forward_cp
from deltacp.parallel.layout import attention_two_d_degree, check_ulysses_degree_value, linear_two_d_degree
from deltacp.parallel.modes import AttentionMethod, LinearMode, attention_method, check_state_passing, linear_mode
from deltacp.parallel.placement import check_sequence_layout
from deltacp.parallel.sliding_attention import check_sliding_attention, install_sliding_attention
from deltacp.parallel.two_d import TwoDGroups, two_d_mixer
from deltacp.parallel.ulysses import ulysses_head_layout
from deltacp.parallel.views import IndexedAttentionView, LinearMixerView, attention_view_of, mixer_view_of

SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
_CP_LAYER = "_deltacp_cp"  # the attribute under which a CP'd linear mixer keeps its LinearLayerCP


def cp_layer_of(module: nn.Module) -> LinearLayerCP | None:
    """What a linear mixer made CP by `LinearAttentionContextParallel` runs with (mode, backend, process groups,
    p2p state hops); None for a module that is not."""
    return getattr(module, _CP_LAYER, None)


class _ContextParallelStyle(ParallelStyle):
    """`apply` = check, one exchange (every rank raises together), groups, install."""

    what = "context parallel style"

    def check_module(self, module: nn.Module, cp: int) -> dict:
        raise NotImplementedError

    def groups(self, cp_mesh: DeviceMesh):
        raise NotImplementedError

    def install(self, module: nn.Module, group, groups) -> nn.Module:
        raise NotImplementedError

    def apply(self, module: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
        """Apply in place to one module and return it."""
        return self._apply(module, cp_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = cp_group_of(device_mesh)
        config = {}
        with LocalChecks() as checks:
            config = self.check_module(module, group.size())
        raise_together(group, type(self).__name__, checks.error, agree=config)
        return self.install(module, group, self.groups(device_mesh))


class LinearAttentionContextParallel(_ContextParallelStyle):
    """A linear-attention module under CP. mode: a registered linear-attention mode (`parallel/modes.py`: ulysses | p2p |
    all_gather; or its resolved `LinearMode`, as a `CPPlan` passes it: the plan validated every setting);
    backend: eager | triton; ulysses_degree: None (1-D: `mode` over the whole CP group) or u dividing cp; u < cp
    is the 2-D layout, Ulysses inside groups of u consecutive CP ranks and `mode` across them (`layout.py`);
    state_passing: how p2p's state travels, "chain" (P - 1 hops) or "scan" (ceil(log2 P) rounds, `scan.py`);
    sequence_layout: which tokens each rank holds, "contiguous" or "balanced" (`placement.py`)."""

    def __init__(self, mode: str | LinearMode = "ulysses", backend: str = "eager", ulysses_degree: int | None = None,
                 state_passing: str = "chain", sequence_layout: str = "contiguous"):
        super().__init__()
        if isinstance(mode, LinearMode):  # resolved by a CPPlan, whose validation covered every setting here
            self.cp_mode = mode
        else:
            check_sequence_layout(sequence_layout)
            self.cp_mode = linear_mode(mode, backend)
            check_ulysses_degree_value(ulysses_degree)
            check_state_passing(state_passing, self.cp_mode)
        self.sequence_layout = sequence_layout
        self.mode = self.cp_mode.name
        self.backend = backend
        self.ulysses_degree = ulysses_degree
        # the state hops of a mode that has them: "chain" (P - 1 hops) or "scan" (log-depth, parallel/scan.py)
        self.state_passing = state_passing
        self.linear_backend = get_gdn_backend(backend)  # raises here if the backend is unavailable

    def groups(self, cp_mesh: DeviceMesh) -> TwoDGroups | object | None:
        """1-D: the state-hop group of a mode with state hops (None in the others). 2-D: a `TwoDGroups` (Ulysses
        group, across group, and for a mode with state hops its own across group)."""
        cp = cp_group_of(cp_mesh).size()
        u = linear_two_d_degree(cp, self.ulysses_degree, self.mode)
        if u is not None:
            return TwoDGroups(ulysses=ulysses_subgroup(cp_mesh, u), across=across_subgroup(cp_mesh, u),
                              across_p2p=across_subgroup(cp_mesh, u) if self.cp_mode.state_hops else None)
        if not self.cp_mode.state_hops:
            return None
        return dedicated_cp_groups(cp_mesh) if cp > 1 else cp_group_of(cp_mesh)

    def check_module(self, module: nn.Module | LinearMixerView, cp: int) -> dict:
        """Validate the module (through its family's view) for this mode and return the configuration every rank
        must share."""
        view = mixer_view_of(module)
        conv, layout = view.conv, view.layout  # conv None: the mixer has none (no halo, no activation of ours)
        if conv is not None and (conv.stride[0] != 1 or conv.groups != layout.channels
                                 or conv.in_channels != conv.out_channels):
            raise ValueError(f"linear attention CP needs a depthwise causal conv with stride 1 and groups == the "
                             f"pre-conv channels ({layout.channels}); got stride {conv.stride[0]}, groups "
                             f"{conv.groups}")
        if conv is not None and conv.padding[0] != (conv.kernel_size[0] - 1) * conv.dilation[0]:
            raise ValueError(f"linear attention CP needs a causal conv with padding (kernel-1)*dilation = "
                             f"{(conv.kernel_size[0] - 1) * conv.dilation[0]}, got padding {conv.padding[0]}")
        view.recurrence(self.linear_backend)  # raises here (before any collective) for a backend it has no kernels on
        if conv is not None and view.conv_activation not in SILU_NAMES:
            raise NotImplementedError(f"linear attention CP computes the conv's activation as SiLU; this layer's "
                                      f"is {view.conv_activation!r} (hidden_act; SiLU's names: {SILU_NAMES})")
        if layout.value_heads % layout.key_heads:
            raise ValueError(f"{layout.value_setting} ({layout.value_heads}) must be a multiple of "
                             f"{layout.key_setting} ({layout.key_heads})")
        u = linear_two_d_degree(cp, self.ulysses_degree, self.mode)
        if u is not None and layout.value_heads % u:
            raise ValueError(f"ulysses_degree={u} must divide {layout.value_setting} ({layout.value_heads}): in the "
                             f"2-D layout linear layers split their heads over each Ulysses group of {u} ranks")
        if self.cp_mode.across is None:  # the heads split over the whole CP group
            ulysses_head_layout(layout, cp)
        param = view.parameter()
        K, V = view.state_dims
        return dict(linear_attention_cp_mode=self.mode, linear_attention_backend=self.backend, cp=cp,
                    ulysses_degree=u, family=view.family, num_k_heads=layout.key_heads,
                    num_v_heads=layout.value_heads, head_k_dim=K, head_v_dim=V, channels=layout.channels,
                    state_passing=self.state_passing, sequence_layout=self.sequence_layout,
                    conv_kernel=0 if conv is None else conv.kernel_size[0],
                    conv_halo=0 if conv is None else (conv.kernel_size[0] - 1) * conv.dilation[0],
                    dtype=str(param.dtype), device_type=param.device.type)

    def install(self, module: nn.Module, group, groups=None) -> nn.Module:
        """Install the CP forward (after `check_module` and the configuration exchange), with `groups(cp_mesh)`."""
        two_d = isinstance(groups, TwoDGroups)
        view = mixer_view_of(module)
        layer = LinearLayerCP(view=view, group=group, mode=self.cp_mode, backend=self.linear_backend,
                           recurrence=view.recurrence(self.linear_backend),
                           mixer=two_d_mixer if two_d else self.cp_mode.mixer,
                           balanced=self.sequence_layout == "balanced")
        if two_d:
            layer.two_d = groups
            if self.cp_mode.state_hops:
                layer.passing = StatePassing(groups.across_p2p, self.state_passing)
        elif self.cp_mode.state_hops:
            if groups is None:
                raise ValueError(f"linear_attention_cp_mode={self.mode!r} installs with its state-hop group "
                                 f"(LinearAttentionContextParallel.groups)")
            layer.passing = StatePassing(groups, self.state_passing)
        setattr(module, _CP_LAYER, layer)
        module.forward = partial(linear_forward_cp, layer)
        return module


class FullAttentionContextParallel(_ContextParallelStyle):
    """A full attention module under CP. method: a registered full-attention method (`parallel/modes.py`:
    ulysses | all_gather | ring); ulysses_degree: None (1-D) or u < cp: Ulysses inside groups of u consecutive CP
    ranks and `method` (all_gather | ring) across them. A sliding-window layer (its view's `sliding_window`) runs
    its K/V halo over the CP group whatever the method and degree (`sliding_attention.py`). `shared`, for `groups`: the linear-recurrent layers' `TwoDGroups` of the
    same degree, whose collective groups attention reuses. sequence_layout: "contiguous" or "balanced"
    (`placement.py`), as every other layer of the model."""

    def __init__(self, method: str | AttentionMethod = "ulysses", ulysses_degree: int | None = None,
                 block: int | None = None, sequence_layout: str = "contiguous"):
        super().__init__()
        if isinstance(method, AttentionMethod):  # resolved by a CPPlan, whose validation covered every setting here
            self.cp_method = method
        else:
            check_sequence_layout(sequence_layout)
            self.cp_method = attention_method(method)
            check_ulysses_degree_value(ulysses_degree)
        self.sequence_layout = sequence_layout
        self.method = self.cp_method.name
        self.ulysses_degree = ulysses_degree
        self.block = block

    def degree(self, cp: int) -> int:
        """The Ulysses degree of this method at `cp` (the whole group for a method that splits heads; 1: none)."""
        return attention_two_d_degree(cp, self.ulysses_degree, self.method)

    def check_module(self, module: nn.Module, cp: int) -> dict:
        view = attention_view_of(module)
        if view.sliding_window is not None:  # the K/V halo in every method (parallel/sliding_attention.py)
            return dict(check_sliding_attention(view), sequence_layout=self.sequence_layout)
        if isinstance(view, IndexedAttentionView):  # its own method (parallel/indexed_attention.py)
            return dict(check_indexed_attention(view, self.method, self.degree(cp)),
                        sequence_layout=self.sequence_layout)
        return dict(check_attention_module(module, cp, self.method, self.degree(cp)),
                    sequence_layout=self.sequence_layout)

    def groups(self, cp_mesh: DeviceMesh, shared: TwoDGroups | None = None):
        """None for a method that splits heads over the CP group; else the all-gather / ring plan (its groups)."""
        if self.cp_method.splits_heads:
            return None
        degree = self.degree(cp_group_of(cp_mesh).size())
        return attention_cp_plan(cp_mesh, self.method, degree, shared if degree > 1 else None, self.block,
                                 balanced=self.sequence_layout == "balanced")

    def install(self, module: nn.Module, group, groups=None) -> nn.Module:
        if attention_view_of(module).sliding_window is not None:
            return install_sliding_attention(module, group, balanced=self.sequence_layout == "balanced")
        if self.cp_method.splits_heads:
            return install_ulysses_attention(module, group, balanced=self.sequence_layout == "balanced")
        if groups is None:
            raise ValueError(f"full_attention_cp={self.method!r} installs with its plan "
                             f"(FullAttentionContextParallel.groups)")
        view = attention_view_of(module)
        if isinstance(view, IndexedAttentionView):
            return install_indexed_attention(module, view, groups)
        return install_kv_cp_attention(module, groups)
