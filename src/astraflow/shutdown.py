"""How a process ends once its own work is finished and closed: without the interpreter's teardown.

Tearing down an interpreter that has torch and transformers loaded (garbage-collecting tens of
thousands of module objects) takes about a second of CPU, several seconds of wall time on a busy
machine, in every role process and in `astraflow up`. Nothing of the run depends on it: a role
returns its exit code only after it closed its state (SQLite, metrics sinks, sockets) and wrote
its checkpoint, so what is left is what a normal exit does first -- wait for non-daemon threads,
run the atexit handlers (logging flushes its handlers there), flush the standard streams -- and
then the process can leave at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Exit with `code` as a normal exit would, minus the module teardown (see the module docstring).

    Only for a finished command: an error on its way up still takes the normal exit, traceback and all."""
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon and t.is_alive():
            t.join()  # what the interpreter's own shutdown does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: nothing left to save
    os._exit(code)
