"""deltacp: context parallelism for Gated DeltaNet hybrid models (the Qwen3.5 family and Qwen3-Next).

Importing deltacp loads torch (the registry of module views) and nothing else heavy: each public name below is loaded
from its module on first use (PEP 562), so `python -m deltacp.train` can reject a bad config before transformers,
the checkpoint code and the process group load. Importing deltacp never imports Triton;
`linear_attention_backend="triton"` does, lazily.
"""

from __future__ import annotations

import importlib

_PUBLIC: dict[str, str] = {  # name -> the module that defines it
    "run_distributed": "deltacp.distributed.launch",
    "init_cp_mesh": "deltacp.distributed.mesh",
    "supported_classes": "deltacp.models.adapters",
    "shard_batch_for_cp": "deltacp.batching",
    "gather_cp_rows": "deltacp.batching",
    "apply_activation_checkpointing": "deltacp.models.checkpointing",
    "CheckpointingPlan": "deltacp.models.checkpointing",
    "parallelize_and_shard": "deltacp.models.compose",
    "all_reduce_cp_grads": "deltacp.models.fsdp",
    "fully_shard_cp": "deltacp.models.fsdp",
    "unsharded_parameters": "deltacp.models.fsdp",
    "IGNORE_INDEX": "deltacp.losses",
    "cp_causal_lm_loss": "deltacp.losses",
    "cp_cross_entropy": "deltacp.losses",
    "cp_linear_cross_entropy": "deltacp.losses",
    "cp_token_logprobs": "deltacp.losses",
    "linear_token_logprobs": "deltacp.losses",
    "cp_load_balancing_loss": "deltacp.models.moe",
    "parallelize_cp": "deltacp.models.parallelize",
    "cp_plan_of": "deltacp.models.parallelize",
    "row_cut_of": "deltacp.models.parallelize",
    "sequence_layout_of": "deltacp.models.parallelize",
    "suspend_cp": "deltacp.models.parallelize",
    "load_pretrained": "deltacp.checkpoint_io.pretrained",
    "fully_shard_qwen3_5": "deltacp.models.qwen3_5",
    "parallelize_qwen3_5_cp": "deltacp.models.qwen3_5",
    "save_pretrained": "deltacp.checkpoint_io.save",
    "SEQUENCE_LAYOUTS": "deltacp.parallel.placement",
    "CPPlan": "deltacp.parallel.plan",
    "FullAttentionContextParallel": "deltacp.parallel.style",
    "LinearAttentionContextParallel": "deltacp.parallel.style",
    "cp_layer_of": "deltacp.parallel.style",
}

__all__ = sorted(_PUBLIC)


def _register_families() -> None:
    """The model families' views (`models/adapters.py`) register themselves when first needed: a style applied to a
    module imports them then (`parallel/views.py`), not `import deltacp`."""
    from deltacp.parallel.views import register_family_loader

    register_family_loader(lambda: importlib.import_module("deltacp.models.adapters"))


_register_families()


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'deltacp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
