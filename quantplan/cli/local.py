"""The CLI's one door into the worker package: ``--local`` runs a job's body in this process, and ``quantplan
worker`` describes the device this machine serves. No other module of the CLI imports ``worker``; each import here
is made when it is needed, so a command that queues jobs never loads torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store.records import JobRecord
    from store.settings import Settings



def missing_device(params: Mapping[str, Any]) -> Exception | None:
    """The UnsupportedOnDevice a job's device raises on this machine (a CUDA job without CUDA), else None."""
    from quantcore.errors import UnsupportedOnDevice
    from worker.bodies.shared import resolve_device

    try:
        resolve_device(params.get("device"))
    except UnsupportedOnDevice as exc:
        return exc
    return None


def run_here(job: JobRecord, *, settings: Settings, on_progress: Callable[[float, str], Any]) -> None:
    """Run a job written for this process (queue 'local') through the worker's runner: its row ends succeeded,
    failed or (on KeyboardInterrupt, raised again) cancelled, as a worker would leave it."""
    from worker.bodies import body_for
    from worker.runner import run_job

    run_job(job.id, body_for(job.kind), settings=settings, on_progress=on_progress)


def describe_device(queues: list[str]) -> tuple[str, str, str, str | None]:
    """(device, device_name, device_class, torch_version) a worker consuming ``queues`` would announce here: its
    GPU when a gpu queue asks for one and it has one, else its CPU (worker.presence.describe_device)."""
    from worker.presence import describe_device as describe

    return describe(queues)
