"""`quantplan jobs ...`: retrying a job, and saying when no worker consumes a job's queue."""

from __future__ import annotations

import re

from tests.factories import run_cli as run


def test_a_job_for_a_queue_without_a_worker_says_so(tiny_model):
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "quantplan", "calibrate", "tiny", "--device", "cuda"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        seen, deadline = "", time.monotonic() + 120
        while "quantplan worker --queues gpu" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen += proc.stderr.readline()
        assert "queued calibrate on queue 'gpu'" in seen
        # --local is offered only where this machine could run it
        assert ("--local" in seen) == __import__("torch").cuda.is_available()
    finally:
        proc.kill()
        proc.wait()


def test_jobs_retry_queues_a_failed_job_again_or_says_why_not(tiny_model, capsys, qp_settings):
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from store import models as m
    from store import repo
    from store.db import session_scope

    with session_scope(qp_settings) as s:
        failed = repo.create_job(s, kind="calibrate", params={"samples": 3, "seq_len": 16, "device": "cpu",
                                                              "user": "ann"}, queue="cpu", user="ann",
                                 model_id=tiny_model["model_id"])
        repo.finish_job(s, failed.id, status="failed", error="out of memory")
        upload = repo.create_job(s, kind="register", params={"source": "/gone/x.zip", "cleanup_dir": "/gone"},
                                 queue="cpu", user="ann")
        repo.finish_job(s, upload.id, status="failed", error="boom")
        done = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="ann",
                               model_id=tiny_model["model_id"])
        repo.finish_job(s, done.id, status="succeeded")

    code, out, err = run(capsys, "jobs", "retry", str(failed.id))
    assert code == 0, err
    new_id = int(re.search(r"queued again as job #(\d+)", out).group(1))
    again = jobs_svc.get_job(new_id)
    assert again.kind == "calibrate" and again.status == "queued" and again.model_id == tiny_model["model_id"]
    assert {k: again.params[k] for k in ("samples", "seq_len", "device")} == {"samples": 3, "seq_len": 16,
                                                                              "device": "cpu"}
    assert again.requested_by == "tester" and again.params["user"] == "tester"  # asked again by this user

    for job_id, reason in ((done.id, "is succeeded: only a failed or cancelled job"),
                           (upload.id, "upload the file again")):
        code, _, err = run(capsys, "jobs", "retry", str(job_id))
        assert code == 1 and reason in err, err
    code, _, err = run(capsys, "jobs", "retry")
    assert code == 1 and "say which job" in err
    jobs_svc.cancel_job(new_id)
    models_svc.remove_model("tiny")
    code, _, err = run(capsys, "jobs", "retry", str(failed.id))
    assert code == 1 and "tiny was removed by tester" in err and "cannot run on it" in err
    with session_scope(qp_settings) as s:  # a bench job of the removed model is not rerun on other shapes
        bench = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user="ann")
        repo.finish_job(s, bench.id, status="failed", error="boom")
        s.get(m.Job, bench.id).params = {"device": "cpu", repo.REMOVED_MODEL_KEY: "tiny"}
    code, _, err = run(capsys, "jobs", "retry", str(bench.id))
    assert code == 1 and "model tiny was removed" in err
