"""What every ``python -m flower_apps.<command>`` shares at its entry point."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


def run(main: Callable[[], int]) -> NoReturn:
    """Run a command's ``main`` and exit with its status. A reader that closes the pipe before
    the command has written all (``python -m flower_apps.papers scala --list | head -1``) ends it
    quietly with status 1 instead of a ``BrokenPipeError`` traceback: stdout is pointed at
    ``os.devnull`` so that the interpreter's final flush cannot raise again (the recipe of
    Python's ``signal`` docs, "Note on SIGPIPE"). Whatever the command wrote to files before
    (a run's metrics, an attack record) is already on disk."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 1
    sys.exit(code)
