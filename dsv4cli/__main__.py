"""`python -m dsv4cli` runs the `dsv4` command."""

import sys

from dsv4cli.cli import main

sys.exit(main())
