"""Linear recurrences whose state only decays (a scalar per head): Mamba2's SSD and simple gated linear attention."""
