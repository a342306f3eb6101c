"""Moved to `deltacp.checkpoint_io.save`; this path keeps working (it is that module)."""

import sys

from deltacp.checkpoint_io import save as _moved

sys.modules[__name__] = _moved
