"""The console the verbs print their tables on."""
import sys

from rich.console import Console


def table_console() -> Console:
    """stdout as rich sees it: on a terminal its width; piped, wide enough that no cell is cut to `…` (rich
    assumes 80 columns when it cannot ask a terminal)."""
    return Console() if sys.stdout.isatty() else Console(width=1000)
