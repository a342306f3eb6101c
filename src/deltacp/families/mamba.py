"""Mamba (`MambaForCausalLM`, `MambaModel`; transformers 5.25): its family record and the Mamba1 mixer's view. A pure
SSM: no attention, no MLP (`Family.attention` and `Family.mlp` None).

Blocks (`MambaBlock`, `backbone.layers`): `residual + mixer(norm(x))`, the norm `MambaRMSNorm` (weight x form, eps
`layer_norm_epsilon`), the residual cast to float32 first under `residual_in_fp32` (transformers' own block forward
under CP). Mixer (`MambaMixer`, `layer.mixer`): in_proj H -> 2I = [x | z] (bias under `use_bias`), a depthwise causal
conv over x (kernel `conv_kernel`, bias under `use_conv_bias`, `hidden_act` SiLU), x_proj I -> [dt (`time_step_rank`)
| B (`state_size`) | C] (no bias), dt_proj (rank -> I, with bias: dt = softplus(dt_proj.weight dt + bias), no clamp),
A = -exp(A_log) [I, N], the selective scan with the D skip and the silu(z) gate (`ops/selective/eager.py`), out_proj
(bias under `use_bias`); the padding mask applied before in_proj and after the conv (`apply_mask_to_padding_states`),
as the CP layer does (`parallel/shard.py`). The final norm is `norm_f`, the embedding `embeddings` (older checkpoints:
`embedding`, read by `load_pretrained` through `Family.checkpoint_load_aliases`, as for Mamba2: transformers 5.25's
from_pretrained never calls its `MambaModel.load_hook`); the causal LM holds the model as `backbone` (its checkpoint
prefix: no renames). `MambaForCausalLM.forward` takes **kwargs and does not
hand them to `backbone`: the packing keywords would never reach the text model and a packed row would run as one
document, so the family sets `lm_passes_kwargs=False` and deltacp relays them past the causal LM
(`models/inputs.make_keyword_relay`). `use_mambapy` / `use_associative_scan` pick another torch
scan of the same recurrence; `time_step_*`, `rescale_prenorm_residual`, `initializer_range` touch initialisation only.

CP: the view declares I heads of one channel each (state N x 1 per head, M diagonal), so Ulysses and the 2-D layout
split the channels over ranks (CP or Ulysses degrees dividing I) as they split any heads; the recurrence runs one
scan over a rank's channels (B and C shared by all of them: one group, `ops/selective`). x_proj reads every
channel of the conv output, so where the channels are split (`reads_every_head`) each rank multiplies its channels
by their columns of x_proj and the partial products (dt before dt_proj, B, C: rank + 2N numbers a token) are summed
over the ranks holding the others (`LinearShard.head_sum`: an all-reduce, its backward an all-reduce too); dt_proj's
rows, A, D and the scan are the rank's channels' own. Under p2p and all_gather every channel is on every rank (no
sum). The conv halo is kernel - 1 tokens of x. The gate z travels as the heads' extras (one per channel), since
transformers' scan applies it inside, after the entering state's contribution.
Backends: eager (`ops/selective/eager.py`) and Triton (`ops/selective/triton`: chunked scans with the state in
registers, no [T, I, N] tensor; the view hands it x, dt after softplus, A, B, C, D and z as they are, A and D
expanded over the rows with stride 0).

Shape legend: x_BsD local hidden states; pre_BsC pre-conv x [B, s, I]; extras_BsHX z [B, s, I, 1].
"""

from __future__ import annotations

import torch.nn.functional as F

from deltacp.families.registry import Family, register_family
from deltacp.ops.precision import compute_dtype
from deltacp.ops.recurrence import RecurrenceInputs
from deltacp.parallel.views import HeadLayout, LinearMixerView

class MambaView(LinearMixerView):
    """A Mamba1 mixer with transformers' attribute names (in_proj = [x | z], conv1d, x_proj, dt_proj, A_log, D,
    out_proj; intermediate_size, ssm_state_size, time_step_rank): a head per channel (module docstring).
    FalconMamba and Jamba override `dt_b_c` (their norms)."""

    family = "mamba"
    extras = 1  # z, per channel
    reads_every_head = True  # x_proj
    channels_setting = "intermediate_size (expand x hidden_size)"  # the config fields that set I, for errors

    @property
    def layout(self) -> HeadLayout:
        I = self.module.intermediate_size
        return HeadLayout(I, I, (("value", 1),), key_setting=self.channels_setting,
                          value_setting=self.channels_setting)

    @property
    def conv_activation(self) -> str:
        return self.module.activation

    @property
    def state_dims(self) -> tuple[int, int]:
        return self.module.ssm_state_size, 1

    def conv_heads(self, key_heads: int) -> tuple[tuple[int, int], ...]:
        return ((-1, 1),)

    def project(self, x_BsD):
        x, z = self.module.in_proj(x_BsD).chunk(2, dim=-1)
        return x, z[..., None], x_BsD.dtype

    def dt_b_c(self, proj):
        """(dt before dt_proj, B, C) from x_proj's output [rows, n, rank + 2N]."""
        m = self.module
        return proj.split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)

    def inputs(self, parts, extras_BnHX, heads: slice, backend, head_sum) -> RecurrenceInputs:
        """The scan's inputs of channels `heads`: x_proj over them (its columns), summed over every channel by
        `head_sum`, then dt_proj's, A's and D's rows of these channels."""
        m = self.module
        (x,) = parts
        x = x[..., 0]  # [rows, n, channels here]
        rows = x.shape[0]
        dt, b, c = self.dt_b_c(head_sum(F.linear(x, m.x_proj.weight[:, heads])))
        dt = F.softplus(F.linear(dt, m.dt_proj.weight[heads]) + m.dt_proj.bias[heads].to(dt.dtype))
        cd = compute_dtype(x)
        a = -m.A_log[heads].to(cd).exp()
        return RecurrenceInputs(x, dt, a.expand(rows, *a.shape), b, c, m.D[heads].to(cd).expand(rows, -1),
                                extras_BnHX[..., 0])

    def recurrence(self, backend):
        if backend.name == "triton":
            from deltacp.ops.selective.triton import TritonSelectiveScan

            return TritonSelectiveScan()
        from deltacp.ops.selective.eager import SelectiveScan

        return SelectiveScan()

    def output(self, o_BsHV, out, backend):
        B, s = o_BsHV.shape[:2]
        return self.module.out_proj(o_BsHV.reshape(B, s, -1).to(out))


def mamba_family(name: str, prefix: str, view, **fields) -> Family:
    return Family(
        name, f"transformers.models.{name}.modeling_{name}", causal_lm=f"{prefix}ForCausalLM",
        text_model=f"{prefix}Model", linear_mixer=f"{prefix}Mixer", attention=None, norm=f"{prefix}RMSNorm", mlp=None,
        text_config=f"{prefix}Config", mixer_view=view, fused_decoder=False, linear_attribute="mixer",
        text_attribute="backbone", moe_fields=None, mask_through_layers=True, lm_passes_kwargs=False, **fields)


# MambaModel.load_hook's older name of the embedding (module docstring)
MAMBA = register_family(mamba_family("mamba", "Mamba", MambaView,
                                     checkpoint_load_aliases=(("embeddings", "embedding"),)))
