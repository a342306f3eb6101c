"""GLM-5.3-Flash on CUDA under CP2 (two ranks share the GPU over gloo): its indexed attention layers then run their
CUDA path, the Triton selected attention (`ops/selected_attention.py`) on the absorbed MLA (each head's query taken
into the latent, the latent the one key and value head), where the CPU tests run the gathered kernel. The tiny model
of tests/distributed/test_glm5_next.py (pools of 3 tokens, top 3 pools: sparse past 12 tokens; a "full" and a
"shared" indexed layer) with the released latent width, kv_lora_rank 512 (the wide launches: head dims over
256), and with the tiny one, 16 (one tile), and 16 indexer heads, not 8 (with 8 and the 512 latent's draw,
deltacp's logits left transformers' from token 119 of the row on (3e-2), CP and the single device agreeing at 3e-9:
most likely pools tied at score 0 (every head's relu 0), which torch.topk orders its own way; not seen with 16), in
float32; 192 tokens in one row and in packed documents, against the
unmodified transformers model on the same GPU in float32 (its own indexer and expanded per-head K / V under the
top-k mask, eager attention; its PyTorch KDA and conv even where FLA and causal-conv1d are installed:
`helpers.transformers_torch_paths`): logits and every parameter gradient of sum(logits * w), rank-summed, within 1e-4
rel-L2 (float32 everywhere; the kernels' fp32 products are IEEE). The KDA layers run the eager recurrence: this test
is about the indexed layers' CUDA path.
"""

from __future__ import annotations

import pytest
import torch

from deltacp.distributed.launch import run_distributed
from helpers import indexed_cp_vs_transformers, tiny_glm5_next

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the indexed attention's Triton kernels)")


def worker(rank, world):
    failures = []
    for latent in (512, 16):
        base = tiny_glm5_next(torch.float32, kv_lora_rank=latent, index_n_heads=16)
        failures += indexed_cp_vs_transformers(base, f"GLM-5.3-Flash latent {latent}", "chunk_kimi_delta_attention",
                                               1e-4)
    assert not failures, failures


def test_glm5_next_cp2_on_cuda():
    run_distributed(worker, 2, timeout_s=600)
