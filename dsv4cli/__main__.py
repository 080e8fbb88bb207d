"""`python -m dsv4cli` runs the `dsv4` command."""

from dsv4cli.cli import dsv4

dsv4()
