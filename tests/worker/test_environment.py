"""The software a job ran with (worker/environment.py): the commit of a git checkout, ``+dirty`` where tracked files
changed, the build's QUANTPLAN_GIT_COMMIT where the code is no checkout (the image), and the versions recorded."""

from __future__ import annotations

import subprocess

import torch
import transformers

from worker import environment as env


def _git(root, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_a_checkouts_commit_and_its_dirty_mark(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert env.git_commit.__wrapped__(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert env.git_commit.__wrapped__(tmp_path) == f"{head}+dirty"


def test_no_checkout_reads_the_builds_commit_or_says_none(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANTPLAN_GIT_COMMIT", raising=False)
    assert env.git_commit.__wrapped__(tmp_path) is None
    monkeypatch.setenv("QUANTPLAN_GIT_COMMIT", "0123abc")
    assert env.git_commit.__wrapped__(tmp_path) == "0123abc"


def test_the_versions_recorded_are_this_processs():
    got = env.environment()
    assert got["torch"] == str(torch.__version__)
    assert got["transformers"] == transformers.__version__
    assert got["cuda"] == torch.version.cuda
    assert set(got) == {"quantplan", "git_commit", "python", "torch", "transformers", "cuda"}
