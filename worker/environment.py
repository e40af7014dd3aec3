"""The software a worker runs a job with, recorded on the job's row as it starts (``jobs.environment``, shown on the
run's page): quantplan's version and the git commit of its code, python, torch, transformers and the CUDA torch was
built with. A value that cannot be found is None (a CPU build of torch has no CUDA; an installed image, no git)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

CODE_ROOT = Path(__file__).resolve().parent.parent  # the folder quantplan's packages are loaded from


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_commit(root: Path = CODE_ROOT) -> str | None:
    """The commit the code was checked out at, ``+dirty`` where tracked files differ from it; None where the code
    is no git checkout (an installed image: then ``QUANTPLAN_GIT_COMMIT``, set at the image's build, where given) or
    git is missing. Read once per process: the code a process runs is the code it loaded."""
    if not (root / ".git").exists():
        return os.environ.get("QUANTPLAN_GIT_COMMIT") or None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if head and changed else head or None


def environment() -> dict[str, Any]:
    """The software this process runs jobs with (keys: store.history.ENVIRONMENT_KEYS)."""
    try:
        import torch

        cuda = torch.version.cuda
        torch_version: str | None = str(torch.__version__)
    except ImportError:  # a register job on a worker without torch still runs
        cuda, torch_version = None, None
    return {"quantplan": _version("quantplan"), "git_commit": git_commit(), "python": platform.python_version(),
            "torch": torch_version, "transformers": _version("transformers"), "cuda": cuda}
