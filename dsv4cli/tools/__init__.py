"""Checkpoint tools: `dsv4 inspect` and `dsv4 convert`."""
