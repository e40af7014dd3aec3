"""Task names and queues: a job goes to the queue its device needs, by the task name the worker registers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.routing import TASK_NAMES, queue_for, task_name
from jobs.specs import SPECS, BenchSpec, CalibrateSpec


def test_every_job_kind_has_a_task_name_under_quantplan():
    assert set(TASK_NAMES) == set(SPECS)
    assert all(task_name(kind) == f"quantplan.{kind}" for kind in SPECS)


def test_an_unknown_kind_has_no_task():
    with pytest.raises(ValueError, match="unknown job kind 'export'"):
        task_name("export")


def test_a_job_goes_to_the_queue_of_its_device_unless_it_names_one():
    assert queue_for("calibrate", {}) == "cpu"
    assert queue_for("calibrate", {"device": "cpu"}) == "cpu"
    assert queue_for("score", {"device": "cuda"}) == "gpu"
    assert queue_for("score", {"device": "cuda:1"}) == "gpu"
    assert queue_for("bench", {"device": "cuda", "queue": "gpu.sm90"}) == "gpu.sm90"
    assert queue_for("bench", BenchSpec(device="cuda").to_params()) == "gpu"
    assert queue_for("calibrate", CalibrateSpec().to_params()) == "cpu"


def test_the_job_contracts_import_no_torch_worker_or_front_end():
    code = ("import sys, jobs.specs, jobs.routing, jobs.errors, jobs.client, jobs.workers\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'streamlit', 'worker',"
            " 'app', 'quantplan', 'quantcore'})\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_the_spec_modules_import_neither_celery_nor_sqlalchemy():
    code = ("import sys, jobs.specs, jobs.routing, jobs.errors\n"
            "print(','.join(m for m in ('celery', 'sqlalchemy', 'store') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""
