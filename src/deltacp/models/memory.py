"""Moved to `deltacp.train.memory`; this path keeps working (it is that module)."""

import sys

from deltacp.train import memory as _moved

sys.modules[__name__] = _moved
