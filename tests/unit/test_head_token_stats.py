"""head_token_stats (ops/lm_head/metrics.py) against full float64 logits: the entropy sum and top-1 hits over the
valid targets, over several token chunks, one of them with no valid target."""

import torch

from deltacp.ops.lm_head import IGNORE_INDEX, head_token_stats


def test_head_token_stats_match_full_logits():
    g = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = 37, 16, 50
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64)
    logits = h @ w.T + b
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::3] = logits.argmax(-1)[::3]  # some hits for sure
    targets[8:16] = IGNORE_INDEX  # chunk 2 (chunk_size 8) has no valid target
    targets[-1] = IGNORE_INDEX
    valid = targets != IGNORE_INDEX
    p = torch.softmax(logits, -1)
    entropy = -(p * torch.log_softmax(logits, -1)).sum(-1)
    expected = torch.stack([entropy[valid].sum(), (logits.argmax(-1) == targets)[valid].sum().double(),
                            valid.sum().double()])
    got = head_token_stats(h, w, b, targets, chunk_size=8)
    assert got.dtype == torch.float64
    assert torch.allclose(got, expected, rtol=1e-12, atol=0), (got, expected)
    assert got[1] >= 9  # the 9 forced hits at valid targets counted
