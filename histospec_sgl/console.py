"""The console the command line prints its tables on."""

from __future__ import annotations

import sys
from typing import Any

#: Off a terminal (a log file, a pipe, CI) tables are printed in full at this width, not cut to 80.
WIDE = 1000


def console() -> Any:
    """A ``rich`` console: the terminal's width on a terminal; elsewhere wide enough that no table
    column is cut or wrapped."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=WIDE)
