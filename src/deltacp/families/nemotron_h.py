"""Nemotron-H (`NemotronHForCausalLM`, `NemotronHModel`; transformers 5.25): its family record, Mamba2 view and
attention view.

Blocks (`NemotronHBlock`): one pre-norm `layer.mixer` each, of the kind `layers_block_type` names: a Mamba2 mixer
(`NemotronHMamba2Mixer`: in_proj -> [z | xBC | dt], conv with bias over [x | B | C], the SSD scan with the D skip,
the gated RMSNorm over groups, out_proj; `families/mamba2.py`), an attention (`NemotronHAttention`: GQA, no q/k
norm, no gate, no RoPE anywhere in the model), or a token-wise MLP / MoE block (relu2 experts, a shared expert, a
DeepSeek-V3 router without an auxiliary loss), which CP leaves as it is. The adapter tells the mixer kinds apart by
class (`Family.linear_mixer`, `Family.attention`). The final norm is `norm_f`, the input embedding `embeddings`.
Checkpoints keep the model under `backbone.` and the relu2 experts per expert (`mixer.experts.{e}.up_proj.weight`,
`down_proj.weight`), as transformers' conversion mapping reads and writes them.
"""

from __future__ import annotations

from deltacp.families.attention import PlainAttentionView
from deltacp.families.mamba2 import Mamba2View
from deltacp.families.registry import Family, register_family


class NemotronHMamba2View(Mamba2View):
    family = "nemotron_h"
    groups_setting = "n_groups"
    heads_setting = "mamba_num_heads"


class NemotronHAttentionView(PlainAttentionView):
    family = "nemotron_h"


NEMOTRON_H = register_family(Family(
    "nemotron_h", "transformers.models.nemotron_h.modeling_nemotron_h", causal_lm="NemotronHForCausalLM",
    text_model="NemotronHModel", linear_mixer="NemotronHMamba2Mixer", attention="NemotronHAttention", norm="NemotronHRMSNorm",
    mlp="NemotronHMLP", text_config="NemotronHConfig", mixer_view=NemotronHMamba2View,
    attention_view=NemotronHAttentionView, fused_decoder=False, linear_attribute="mixer", attention_attribute="mixer",
    moe_fields=None,  # its router has no auxiliary loss
    checkpoint_renames=(("model", "backbone"),)))  # transformers 5.25's "nemotron_h" mapping (experts: per expert)
