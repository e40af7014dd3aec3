"""The Models page offers gemma-3-270m as a one-click demo beside SmolLM2."""

from __future__ import annotations

from tests.app.test_pages import _run


def test_models_page_offers_gemma_beside_smollm2_and_queues_its_registration(seeded):
    from quantplan.services import jobs as jobs_svc
    from store import repo
    from store.db import session_scope

    at = _run("models", seeded.id)
    assert not at.button(key="register_demo_gemma").disabled and not at.button(key="register_demo").disabled
    at.button(key="register_demo_gemma").click().run()
    assert not at.exception
    note = next(m.value for m in at.success if "Queued registration job #" in m.value)
    job = jobs_svc.get_job(int(note.split("#", 1)[1].split(".", 1)[0]))
    assert (job.kind, job.params.get("demo"), job.params.get("demo_model")) == ("register", True, "gemma3-270m")
    with session_scope() as s:
        gemma = repo.add_model(s, name="gemma-3-270m", sha256="ef" * 32, source_kind="demo",
                               source_name="gemma-3-270m-q4_k_m.gguf", path="models/g", summary=dict(seeded.summary),
                               user=None)
    at = _run("models", seeded.id)
    assert at.button(key="register_demo_gemma").disabled
    assert not at.button(key="register_demo").disabled  # SmolLM2 is still to register
    assert f"Registered as #{gemma.id} gemma-3-270m." in [c.value for c in at.caption]
