"""The released Qwen3.5 dense text-model shapes, as `Qwen3_5TextConfig` fields.

    Qwen3_5TextConfig(**qwen3_5_preset("9B"))                 # the 9B's text model, randomly initialised
    train.model: {preset: 9B, config: {num_hidden_layers: 8}}  # the trainer: preset fields, then overrides

Every size: vocabulary 248,320, layers repeating (3 GDN, 1 full attention), full attention head_dim 256 with
partial rotary 0.25 (64 rotary dims) and rope theta 1e7, GDN key/value head dims 128, conv kernel 4, context
262,144. The per-size fields (hidden, FFN, layers, heads, tied embeddings) are those of the Hugging Face model
cards and config.json files of Qwen/Qwen3.5-{0.8B, 2B, 4B, 9B, 27B}; the 9B's equal transformers'
`Qwen3_5TextConfig` defaults. No weights are implied: pretrained checkpoints load with `train.model.pretrained`.
"""

from __future__ import annotations

_COMMON = dict(
    vocab_size=248_320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    max_position_embeddings=262_144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)

# hidden, intermediate (FFN), layers, attention heads / KV heads, GDN QK heads / V heads, tied embeddings
_SIZES = {
    "0.8B": (1024, 3584, 24, 8, 2, 16, 16, True),
    "2B": (2048, 6144, 24, 8, 2, 16, 16, True),
    "4B": (2560, 9216, 32, 16, 4, 16, 32, True),
    "9B": (4096, 12288, 32, 16, 4, 16, 32, False),
    "27B": (5120, 17408, 64, 24, 4, 16, 48, False),
}
QWEN3_5_PRESETS: tuple[str, ...] = tuple(_SIZES)


def qwen3_5_preset(size: str) -> dict:
    """`Qwen3_5TextConfig` keyword arguments of a released Qwen3.5 dense size (one of QWEN3_5_PRESETS)."""
    if size not in _SIZES:
        raise ValueError(f"Qwen3.5 preset {size!r} is not known; expected one of {QWEN3_5_PRESETS}")
    hidden, ffn, layers, heads, kv_heads, qk_heads, v_heads, tied = _SIZES[size]
    return dict(_COMMON, rope_parameters=dict(_COMMON["rope_parameters"]), hidden_size=hidden,
                intermediate_size=ffn, num_hidden_layers=layers,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
                num_attention_heads=heads, num_key_value_heads=kv_heads, linear_num_key_heads=qk_heads,
                linear_num_value_heads=v_heads, tie_word_embeddings=tied)
