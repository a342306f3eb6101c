"""pad_packed_row (re-exported by deltacp.models.qwen3_5 for older imports): its third argument is the multiple the
row is padded to, as before; `min_length` adds the shortest row a model's pieces admit."""

import pytest
import torch

from deltacp.batching import pad_packed_row

pytestmark = pytest.mark.fast


def test_pad_packed_row_pads_to_a_multiple_with_one_padding_document():
    ids, cu = torch.arange(1, 6)[None], torch.tensor([0, 2, 5], dtype=torch.int32)
    out, offsets = pad_packed_row(ids, cu, 4, pad_token_id=-1)
    assert out.tolist() == [[1, 2, 3, 4, 5, -1, -1, -1]] and offsets.tolist() == [0, 2, 5, 8]
    assert offsets.dtype == torch.int32
    out, offsets = pad_packed_row(ids, cu, 4, min_length=9)  # at least 9, a multiple of 4
    assert out.shape == (1, 12) and offsets.tolist() == [0, 2, 5, 12]
    out, offsets = pad_packed_row(ids, cu, 5)  # already a multiple: unchanged
    assert out is ids and offsets is cu
