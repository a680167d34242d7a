"""A finished role leaves through shutdown.exit_process: nothing a normal exit would save is lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import atexit, logging, sys, threading, time
from pathlib import Path
from astraflow.shutdown import exit_process

out = Path(sys.argv[1])
handler = logging.FileHandler(out / "log.txt", delay=False)
handler.setFormatter(logging.Formatter("%(message)s"))
logging.getLogger("x").addHandler(handler)
logging.getLogger("x").warning("logged last")
atexit.register(lambda: (out / "atexit.txt").write_text("ran"))

def late_writer() -> None:
    time.sleep(0.3)  # still running when exit_process is called: a normal exit would wait for it
    (out / "thread.txt").write_text("written")

threading.Thread(target=late_writer).start()
sys.stdout.write("buffered stdout")
exit_process(3)
"""


def test_exit_process_keeps_logs_atexit_threads_and_stdout(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered stdout"
    assert (tmp_path / "log.txt").read_text() == "logged last\n"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "written"
