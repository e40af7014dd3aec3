"""Real processes: a Celery worker (and the Streamlit app) started as a user would start them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        self._fh = open(log, "wb")
        self.p = subprocess.Popen(args, env=env, cwd=ROOT, stdout=self._fh, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            if self.p.poll() is not None:
                raise RuntimeError(f"process exited ({self.p.returncode}):\n{self.text()[-4000:]}")
            time.sleep(0.3)
        raise TimeoutError(f"no {needle!r} after {timeout} s:\n{self.text()[-4000:]}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self._fh.close()


def start_worker(tmp_path: Path, queues: str = "cpu") -> Proc:
    env = dict(os.environ)
    proc = Proc([sys.executable, "-m", "quantplan", "worker", "--queues", queues], env, tmp_path / "worker.log")
    try:
        proc.wait_for(" ready.", timeout=120)
    except Exception:
        proc.stop()
        raise
    return proc


@pytest.fixture
def worker(qp_settings, tmp_path):
    proc = start_worker(tmp_path)
    yield proc
    proc.stop()
