"""The Celery configuration the senders and the worker share."""

from __future__ import annotations

from jobs.broker import make_celery


def test_celery_limits_follow_the_setting_and_zero_means_none(qp_settings):
    """Celery's own limits (enforced only by its prefork / gevent pools) and Redis's redelivery follow the job
    time limit; 0 sets no limit at all, not a 120 s hard one."""
    redis = {"broker_url": "redis://127.0.0.1:6379/9"}
    limited = make_celery(qp_settings.model_copy(update={"job_soft_time_limit_s": 100, **redis})).conf
    assert (limited.task_soft_time_limit, limited.task_time_limit) == (100, 220)
    assert limited.broker_transport_options["visibility_timeout"] == 700
    none = make_celery(qp_settings.model_copy(update={"job_soft_time_limit_s": 0, **redis})).conf
    assert (none.task_soft_time_limit, none.task_time_limit) == (None, None)
    assert none.broker_transport_options["visibility_timeout"] == 7 * 24 * 3600 + 600
