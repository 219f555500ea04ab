"""The last word under a launcher: ``torchrun`` and ``accelerate launch`` end a run that a signal stopped, or whose
processes refused to start, with their own report (a ``SignalException`` or ``ChildFailedError`` traceback and exit
status 1), which no process they launched can prevent. :func:`say_after_launcher` has the first process repeat its
last line after that report: a small detached process waits for the launcher to exit, then prints the line on the
same stderr, so that what the user sees last says what happened (the checkpoint and the resume command, or the
refusal). Outside a launcher it does nothing.

Under a launcher a stop also has a deadline: on Ctrl-C the launcher signals the processes and kills them
:func:`shutdown_timeout` seconds later (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, torchrun's ``--shutdown-timeout``;
default 30), so the iteration in progress and the checkpoint must fit in it.
"""

from __future__ import annotations

import os
import subprocess
import sys

# waits for the process argv[1] to end (gone, or a zombie not yet reaped), then prints argv[2] on stderr
_WATCH = """import os, sys, time
pid, line, end = int(sys.argv[1]), sys.argv[2], time.monotonic() + float(sys.argv[3])
def alive():
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
while alive() and time.monotonic() < end:
    time.sleep(0.05)
if not alive():
    print(line, file=sys.stderr, flush=True)
"""


def launched() -> bool:
    """Whether this process was started by torchrun or ``accelerate launch`` (torch's elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def shutdown_timeout() -> int:
    """Seconds the launcher waits for its processes after a Ctrl-C before killing them (as torch's launcher reads
    them: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30; torchrun's ``--shutdown-timeout`` is not visible here)."""
    try:
        return int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    except ValueError:
        return 30


def say_after_launcher(line: str, wait_s: float = 3600.0) -> bool:
    """Under a launcher, on its first process (``RANK`` 0): print ``line`` on stderr once the launcher has exited
    (waiting at most ``wait_s`` seconds, in a detached process). Returns whether it will."""
    if not launched() or os.environ.get("RANK", "0") != "0":
        return False
    subprocess.Popen([sys.executable, "-c", _WATCH, str(os.getppid()), line, str(wait_s)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return True
