"""Linear recurrences whose decay is elementwise over the state (a `diagonal` transition): Mamba1's selective scan."""
