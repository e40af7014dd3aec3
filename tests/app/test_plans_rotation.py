"""The Plans page's rotation control: a Hadamard rotation chosen on the page is saved in the plan's transforms and
exported as llm-compressor's SpinQuantModifier ahead of the quantization."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def test_a_rotation_chosen_on_the_plans_page_is_saved_and_exported(seeded):
    from quantplan.services import exchange as exchange_svc
    from quantplan.services import plan_editor as plan_editor_svc
    from store import repo
    from store.db import session_scope

    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = seeded.id
    at.run()
    at.switch_page("views/plans.py").run()
    assert not at.exception, [e.value for e in at.exception]
    rot = next(w for w in at.selectbox if w.label == "Rotation (before quantizing)")
    assert rot.value == "none"
    rot.set_value("hadamard").run()
    next(w for w in at.number_input if w.label.startswith("Rotation block size")).set_value(16).run()
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    assert not at.exception, [e.value for e in at.exception]
    with session_scope() as s:
        body = repo.list_plans(s, seeded.id)[-1].body
    assert body["transforms"] == {"rotation": {"kind": "hadamard", "rotations": ["R1", "R2", "R4"], "block_size": 16}}
    recipe = exchange_svc.export_plan(seeded, body, "llmcompressor")
    assert recipe.index("SpinQuantModifier") < recipe.index("QuantizationModifier")
    assert "transform_block_size: 16" in recipe
    assert "transforms" not in plan_editor_svc.with_rotation(body, "none", 0)
