"""The README's first command as a user runs it: `quantplan up` on an empty home migrates it, starts a worker and
the app, and stops both when it is told to stop, whoever tells it."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from urllib.error import URLError

import pytest

from tests.factories import Proc, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _health(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=5) as r:
            return r.read().decode()
    except (URLError, ConnectionError, TimeoutError):
        return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_up_starts_worker_and_app_on_a_new_home_and_a_sigterm_to_it_alone_stops_both(qp_env, tmp_path):
    port = free_port()
    env = dict(os.environ, QUANTPLAN_UI_PORT=str(port))
    up = Proc([sys.executable, "-m", "quantplan", "up"], env, tmp_path / "up.log")
    kids: list[int] = []
    try:
        up.wait_for("URL: http", timeout=90)  # the children write into the launcher's output
        up.wait_for(" ready.", timeout=120)
        kids = _children(up.p.pid)
        assert len(kids) == 2, f"expected a worker and an app, found {kids}"
        assert _health(port) == "ok"
        assert (Path(qp_env["QUANTPLAN_HOME"]) / "quantplan.sqlite").exists()  # migrated from nothing

        os.kill(up.p.pid, signal.SIGTERM)  # `kill PID`, or a supervisor stopping it: not the process group
        assert up.p.wait(timeout=60) == 0, up.text()[-3000:]
        deadline = time.monotonic() + 10
        while any(_running(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if _running(k)], "a child outlived `quantplan up`"
        assert _health(port) is None  # the port is free again
    finally:
        for k in kids:
            if _running(k):
                os.kill(k, signal.SIGKILL)
        up.stop()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_up_on_a_port_in_use_says_so_and_leaves_no_worker_behind(qp_env, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = dict(os.environ, QUANTPLAN_UI_PORT=str(port))
        up = Proc([sys.executable, "-m", "quantplan", "up"], env, tmp_path / "up.log")
        kids: list[int] = []
        try:
            deadline = time.monotonic() + 60
            while up.p.poll() is None and time.monotonic() < deadline:
                kids = sorted(set(kids) | set(_children(up.p.pid)))
                time.sleep(0.2)
            assert up.p.returncode == 1, up.text()[-3000:]
            assert f"Port {port} is not available" in up.text()  # streamlit says why
            assert "the app exited (code 1); stopping the worker" in up.text()
            assert kids and not [k for k in kids if _running(k)], "the worker outlived the app that could not start"
        finally:
            for k in kids:
                if _running(k):
                    os.kill(k, signal.SIGKILL)
            up.stop()
