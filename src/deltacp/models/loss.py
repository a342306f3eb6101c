"""Moved to `deltacp.losses`; this path keeps working (it is that module)."""

import sys

from deltacp import losses as _moved

sys.modules[__name__] = _moved
