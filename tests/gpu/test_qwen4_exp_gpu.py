"""Qwen4-Exp on CUDA under CP2 (two ranks share the GPU over gloo): the indexed attention layer then runs its CUDA
path, the Triton selected attention (`ops/selected_attention.py`), where the CPU tests run the gathered kernel. The
tiny model of tests/distributed/test_qwen4_exp.py (QSA blocks of 3, top 4 blocks: sparse past 15 tokens) in float32,
192 tokens in one row and in packed documents, against the unmodified transformers model on the same GPU in float32
(its own indexer loop and SDPA, and its PyTorch GDN and conv even where FLA and causal-conv1d are installed:
`helpers.transformers_torch_paths`): logits and every parameter gradient of sum(logits * w), rank-summed, within 1e-4
rel-L2 (float32 everywhere; the kernels' fp32 products are IEEE). The GDN layers run the eager recurrence: this test
is about the indexed layer's CUDA path.
"""

from __future__ import annotations

import pytest
import torch

from deltacp.distributed.launch import run_distributed
from helpers import indexed_cp_vs_transformers, tiny_qwen4_exp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the indexed attention's Triton kernels)")


def worker(rank, world):
    failures = indexed_cp_vs_transformers(tiny_qwen4_exp(torch.float32), "Qwen4-Exp", "torch_chunk_gated_delta_rule",
                                          1e-4)
    assert not failures, failures


def test_qwen4_exp_cp2_on_cuda():
    run_distributed(worker, 2, timeout_s=600)
