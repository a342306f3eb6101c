"""The first-use self-check of the Triton GDN kernels (`deltacp.ops.gdn.triton.selfcheck`) for real on CUDA: it
passes on this GPU with the installed Triton, prints every figure against its bound, caches its verdict, and runs
from the contract check for a Triton version outside TRITON_VERIFIED_ON_GPU. The refusal path and the cache's
failure path are tested on the CPU interpreter (tests/unit/test_triton_selfcheck.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: the self-check runs the Triton kernels for real (the CPU "
                              "interpreter variant is tests/unit/test_triton_selfcheck.py)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    from deltacp.ops.gdn.triton import selfcheck

    monkeypatch.setenv(selfcheck.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    return tmp_path


def test_self_check_passes_on_this_gpu(fresh_cache, monkeypatch):
    import triton

    from deltacp.ops.gdn.triton import selfcheck

    record = selfcheck.run_self_check("cuda")
    print(f"\ntriton {triton.__version__} on {record['key']['device']}: {record['seconds']} s")
    for f in record["figures"]:
        print(f"  {f['name']:52s} {f['value']:.2e}  (bound {f['bound']:.1e})")
    assert record["passed"] and all(f["value"] <= f["bound"] for f in record["figures"])
    assert len(record["figures"]) == 44 * len(selfcheck.SHAPES)
    assert selfcheck.cache_path(record["key"]).is_file()

    def recompute(*a, **kw):
        raise AssertionError("the cached verdict was not used")

    monkeypatch.setattr(selfcheck, "measure", recompute)
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    assert selfcheck.run_self_check("cuda") == record


def test_contract_runs_self_check_for_an_unverified_version(fresh_cache):
    """check_triton_contract on CUDA inputs, with the version reported as one that was not verified on a GPU: the
    self-check runs (on the installed kernels) under that version's key, passes, and the call is accepted."""
    from deltacp.ops.gdn.triton import selfcheck
    from deltacp.ops.gdn.triton.contract_check import check_triton_contract

    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = k = torch.zeros(1, 64, 2, 128, **bf)
    v = torch.zeros(1, 64, 4, 128, **bf)
    g, beta = torch.zeros(1, 64, 4, device="cuda"), torch.zeros(1, 64, 4, **bf)
    check_triton_contract(q, k, v, g, beta, triton_version="3.9.9")
    key = selfcheck.cache_key(torch.device("cuda", torch.cuda.current_device()), "3.9.9")
    assert selfcheck._read_verdict(selfcheck.cache_path(key), key)["passed"]
