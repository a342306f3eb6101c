"""Moved to `deltacp.checkpoint_io.hf_format`; this path keeps working (it is that module)."""

import sys

from deltacp.checkpoint_io import hf_format as _moved

sys.modules[__name__] = _moved
