"""Moved to `deltacp.checkpoint_io.pretrained`; this path keeps working (it is that module)."""

import sys

from deltacp.checkpoint_io import pretrained as _moved

sys.modules[__name__] = _moved
