"""Moved to `deltacp.batching`; this path keeps working (it is that module)."""

import sys

from deltacp import batching as _moved

sys.modules[__name__] = _moved
