"""Every family's conformance table (`tables.py`) on gloo, float64 (`harness.py` says what each row checks), one
spawn per family: at CP2 the defaults row in all six mode / layout / attention / input runs, a row changing a
sequence part in three (every mode and input, one layout), a token-wise row in one; at CP4 one run per row, in turn
(the table's rows meet all six)."""

import pytest

from deltacp.distributed.launch import run_distributed
from conformance.harness import run_table
from conformance.tables import DECAYS, TABLES


@pytest.mark.parametrize("family", list(TABLES))
def test_conformance_cp2(family):
    run_distributed(run_table, 2, TABLES[family], DECAYS[family], timeout_s=1200)


@pytest.mark.parametrize("family", list(TABLES))
def test_conformance_cp4(family):
    run_distributed(run_table, 4, TABLES[family], DECAYS[family], None, True, timeout_s=1200)
