"""The Celery configuration the senders and the worker share."""

from __future__ import annotations

from jobs.broker import make_celery


def test_celery_limits_follow_the_setting_and_zero_means_none(qp_settings):
    """Celery's own limits (enforced only by its prefork / gevent pools) follow the job time limit; 0 sets no limit
    at all, not a 120 s hard one."""
    redis = {"broker_url": "redis://127.0.0.1:6379/9"}
    limited = make_celery(qp_settings.model_copy(update={"job_soft_time_limit_s": 100, **redis})).conf
    assert (limited.task_soft_time_limit, limited.task_time_limit) == (100, 220)
    none = make_celery(qp_settings.model_copy(update={"job_soft_time_limit_s": 0, **redis})).conf
    assert (none.task_soft_time_limit, none.task_time_limit) == (None, None)


def test_redis_brings_a_killed_workers_message_back_when_its_job_is_failed_not_hours_later(qp_settings):
    """A redelivered task of a job that is not queued is dropped (worker.runner), so Redis's visibility timeout
    need not outlast the longest job: it is the stale limit plus one sweep interval, scanned for every interval."""
    redis = {"broker_url": "redis://127.0.0.1:6379/9"}
    default = make_celery(qp_settings.model_copy(update=redis)).conf.broker_transport_options
    assert default == {"visibility_timeout": 150, "unacked_restore_interval": 30, "unacked_restore_throttle": 1}
    quick = make_celery(qp_settings.model_copy(update={"heartbeat_stale_s": 4, **redis})).conf
    assert quick.broker_transport_options["visibility_timeout"] == 5
    assert quick.broker_transport_options["unacked_restore_interval"] == 1
    assert not make_celery(qp_settings).conf.broker_transport_options  # kombu's SQLAlchemy transport: none
