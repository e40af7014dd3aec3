"""Task names and queue routing: which Celery task runs a job kind, and which queue a job goes to.

The app and the CLI send a task by its name (never importing the worker); the worker registers its tasks under
the same names (worker.tasks). Queues are named per device class: ``cpu``, ``gpu``, or a finer ``gpu.sm90`` that a
job asks for explicitly (its ``queue`` parameter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TASK_NAMES: dict[str, str] = {
    "register": "quantplan.register",
    "calibrate": "quantplan.calibrate",
    "score": "quantplan.score",
    "sensitivity": "quantplan.sensitivity",
    "bench": "quantplan.bench",
}
"""The Celery task name of each job kind."""

LOCAL_QUEUE = "local"  # the queue column of a job the CLI runs in its own process (--local): no broker, no worker

NEEDS_CAUSAL_LM = ("score", "sensitivity")  # job kinds that compare next-token distributions


def task_name(kind: str) -> str:
    """The task that runs jobs of ``kind``; ValueError naming the kinds for another."""
    try:
        return TASK_NAMES[kind]
    except KeyError:
        raise ValueError(f"unknown job kind {kind!r}; the kinds are {', '.join(TASK_NAMES)}") from None


def queue_for(kind: str, params: Mapping[str, Any]) -> str:
    """The queue a job goes to: the one its ``queue`` parameter names, else 'gpu' for a job on a CUDA device and
    'cpu' for any other. (``kind`` is part of the contract: every kind routes by device today.)"""
    if params.get("queue"):
        return str(params["queue"])
    device = str(params.get("device") or "cpu")
    return "gpu" if device.startswith("cuda") else "cpu"


__all__ = ["LOCAL_QUEUE", "NEEDS_CAUSAL_LM", "TASK_NAMES", "queue_for", "task_name"]
