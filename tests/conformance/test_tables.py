"""The conformance tables themselves: every supported family has one, every row that is not run says why, and the
README's list of covered knobs (section "Config knobs covered") is the tables'."""

import os

import pytest

from conformance.tables import TABLES

pytestmark = pytest.mark.fast


def test_every_family_has_a_table():
    import deltacp  # noqa: F401  (registers the families)
    from deltacp.families.registry import families

    classes = {family.causal_lm or family.conditional for family in families()}
    assert classes == {t.model_class for t in TABLES.values()}, "a family without a conformance table (or a table of "\
        "a class deltacp does not support): adding a family means writing its table"


def test_rows_are_complete():
    for table in TABLES.values():
        names = [knob.name for knob in table.knobs]
        assert len(names) == len(set(names)), f"{table.family}: two rows of one name"
        assert names[0].startswith("defaults"), f"{table.family}: the first row is the defaults (randomised)"
        for knob in table.knobs:
            assert knob.runs or knob.overrides == {}, f"{table.family} [{knob.name}]: a row not run sets nothing"
            assert knob.runs or knob.refused is None
            if knob.runs and knob.refused is None and not knob.name.startswith("defaults"):
                assert knob.overrides, f"{table.family} [{knob.name}]: a row that runs sets a field"
                assert knob.touches, f"{table.family} [{knob.name}]: say what the row touches"


def test_readme_holds_the_tables_section():
    """README's "Config knobs covered" is `tables.readme_section()` (regenerate it with `PYTHONPATH=src:tests python
    tests/conformance/tables.py`), so it names every row as the tables hold it."""
    from conformance.tables import readme_section

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    assert readme_section() in readme, ("README's section 'Config knobs covered' differs from the tables: regenerate "
                                        "it with `PYTHONPATH=src:tests python tests/conformance/tables.py`")
