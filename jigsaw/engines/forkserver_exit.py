"""Imported by procs.py's fork server alone, the last of its preloads: the server's exit skips
interpreter teardown.

The server ends when the process that started it does.  A normal teardown with torch and
transformers loaded costs it 2-3 CPU-s after its parent is gone (seen: an orphaned server at 75%
CPU for 2 s after a recipe exited, which `jigsaw demo` counted as other work between its runs).
It holds no file, socket or child that needs a teardown; its forks leave through os._exit
already.  Anywhere else (MARK unset: the server's environment alone carries it) importing this
does nothing.
"""

from __future__ import annotations

import atexit
import os

MARK = "JIGSAW_ENGINE_FORK_SERVER"
"""Set (to "1") in the environment the fork server starts with, and only there."""

ARMED = os.environ.pop(MARK, None) == "1"
"""Whether this process is a fork server whose exit skips teardown."""
if ARMED:
    atexit.register(os._exit, 0)  # registered after torch's own handlers: runs before them
