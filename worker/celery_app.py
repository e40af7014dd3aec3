"""The worker's Celery application: the senders' configuration (jobs.broker) plus its tasks (worker.tasks).

The app and the CLI never import this module: they send tasks by name (jobs.client). A worker process is started
on ``worker.celery_app:celery_app`` and imports worker.tasks through ``include``.
"""

from __future__ import annotations

import sys

from celery.signals import worker_init

from jobs.broker import make_celery
from store.logs import configure_logging

celery_app = make_celery(include=["worker.tasks"])


@worker_init.connect
def _configure_logging(**_kwargs: object) -> None:
    """A worker's own lines ("job 12 succeeded", "failed stale jobs: [7]") on its stderr, at QUANTPLAN_LOG_LEVEL."""
    configure_logging(stream=sys.__stderr__, propagate=False)
