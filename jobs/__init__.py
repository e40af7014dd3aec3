"""Typed job contracts: what the pages, the CLI and the worker agree on about a job.

- :mod:`jobs.specs`: one frozen spec per job kind (register, calibrate, score, sensitivity, bench) with its
  defaults, validation and the ``jobs.params`` JSON it is stored as (tolerant of rows of older versions).
- :mod:`jobs.errors`: :class:`~jobs.errors.InvalidJob`, the error a spec raises, with a message for people.
- :mod:`jobs.routing`: the Celery task name of each kind and the queue a job goes to.
- :mod:`jobs.broker`: the Celery configuration the senders and the worker share.
- :mod:`jobs.client`: write a job's row and send its task by name; wait for it.
- :mod:`jobs.workers`: which workers are alive, and on which queues (read from the store).

Imports no torch, transformers, streamlit, worker, app or quantplan; the spec, error and routing modules import
neither celery nor sqlalchemy either.
"""
