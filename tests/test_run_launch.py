"""The tests' launcher runner (:func:`tiny_runs.run_launch`): a launch that outlives its timeout is killed with its
workers, so a hung collective leaves no process behind to load the machine for the rest of the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tiny_runs import run_launch

HANGS = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:                 # a zombie is gone, only not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_launch_past_its_timeout_is_killed_with_its_workers(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_launch([sys.executable, "-c", HANGS, str(pid_file)], timeout=3)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    done = run_launch([sys.executable, "-c", "print('out'); import sys; sys.stderr.write('err'); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err")
