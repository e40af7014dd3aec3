"""The worker's Celery application: the senders' configuration (jobs.broker) plus its tasks (worker.tasks).

The app and the CLI never import this module: they send tasks by name (jobs.client). A worker process is started
on ``worker.celery_app:celery_app`` and imports worker.tasks through ``include``.
"""

from __future__ import annotations

from jobs.broker import make_celery

celery_app = make_celery(include=["worker.tasks"])
