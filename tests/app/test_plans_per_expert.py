"""The Plans page's per-expert plans (issue 43, item 4) on the tests' tiny Qwen3-MoE (tests/factories.py: 2 blocks of
4 experts), registered and swept per expert (`sensitivity --per-expert`) as a user would: with "Experts one by one"
on, a scheme set on one expert's row sets that expert's gate/up/down only, the table reads each expert's own KL, and
the saved version carries per_expert and resolves; with it off, the edit sets the whole block, as it always did."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.app.test_pages import MAIN
from tests.factories import run_cli_json as run_json

BLOCK1 = "model.layers.1.mlp.experts"
PROJS = ("gate_proj", "up_proj", "down_proj")
NEW = "(new plan)"


@pytest.fixture
def moe(qp_settings, capsys, tmp_path):
    from quantplan.services import models as models_svc
    from tests.factories import save_tiny_moe

    folder = save_tiny_moe(tmp_path / "moe", num_experts=4, num_experts_per_tok=2)
    added = run_json(capsys, "models", "add", str(folder), "--name", "moe", "--json")
    run_json(capsys, "sensitivity", "moe", "--scheme", "W4A16", "--per-expert", "--local", "--samples", "1",
             "--seq-len", "8", "--json")
    return models_svc.get_model(added["model_id"])


def _plans_page(model_id: int) -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.session_state["model_id"] = model_id
    at.run()
    at.switch_page("views/plans.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _table(at: AppTest):
    return next(d.value for d in at.dataframe if "fused_with" in d.value.columns)


def _set_row(at: AppTest, model_id: int, layer: str, scheme: str) -> None:
    """Choose ``scheme`` in the layer table's row of ``layer``, as a click in the grid does."""
    row = int(_table(at).index[_table(at)["layer"] == layer][0])
    at.session_state[f"plan_table_{model_id}_{NEW}"] = {"edited_rows": {row: {"scheme": scheme}}, "added_rows": [],
                                                       "deleted_rows": []}
    at.run()
    assert not at.exception, [e.value for e in at.exception]


def test_one_experts_scheme_is_set_alone_with_experts_one_by_one_and_saved_per_expert(moe):
    from quantplan.services import plans as plans_svc
    from store import repo
    from store.db import session_scope

    at = _plans_page(moe.id)
    at.selectbox(key=f"plan_default_{moe.id}_{NEW}").set_value("FP8_DYNAMIC").run()
    toggle = at.checkbox(key=f"plan_pe_{moe.id}_{NEW}")
    assert toggle.label == "Experts one by one (per_expert)" and not toggle.value
    assert "vLLM" in toggle.help and "refuses" in toggle.help
    table = _table(at).set_index("layer")
    assert table.loc[f"{BLOCK1}.2.up_proj", "fused_with"] == 4 * 3 - 1  # off: the whole block

    toggle.check().run()
    assert not at.exception
    table = _table(at).set_index("layer")
    assert table.loc[f"{BLOCK1}.2.up_proj", "fused_with"] == 2  # on: the expert's gate/up/down
    assert any("This plan is per-expert" in c.value for c in at.caption)
    _set_row(at, moe.id, f"{BLOCK1}.2.up_proj", "W4A16")
    table = _table(at).set_index("layer")
    w4 = set(table.index[table["scheme"] == "W4A16"])
    assert w4 == {f"{BLOCK1}.2.{p}" for p in PROJS}
    assert table.loc[f"{BLOCK1}.3.up_proj", "scheme"] == "FP8_DYNAMIC"
    assert any(f"W4A16 set on expert 2 of {BLOCK1} only" in i.value for i in at.info)
    # the per-expert sweep's KL of that expert, on each of its rows (the sweep's own unit, read back from the store)
    from quantplan.services import sweeps as sweeps_svc

    sens, unit_layers = sweeps_svc.sensitivity_map(moe)
    unit = next(u for u, layers in unit_layers.items() if set(layers) == w4)
    assert list(table.loc[sorted(w4), "sensitivity_kl"]) == pytest.approx([sens["W4A16"][unit]] * 3)
    assert not at.error  # a per-expert plan that mixes a block resolves
    assert any("vLLM cannot serve it" in w.value for w in at.warning)  # the serving warning names the mix

    at.text_input(key=f"plan_name_{moe.id}_{NEW}").set_value("mixed")
    next(b for b in at.button if "Save as a new version" in b.label).click().run()
    assert not at.exception, [e.value for e in at.exception]
    with session_scope() as s:
        saved = repo.list_plans(s, moe.id)[-1]
    assert saved.name == "mixed" and saved.body["per_expert"] is True
    resolved, problem = plans_svc.resolve(moe, saved.body)
    assert problem is None and {n for n, s in resolved.items() if s.name == "W4A16"} == w4
    # export as for any plan: the recipe holds the mix, vLLM's command is refused with the block named
    assert not at.error and "W4A16" in next(c.value for c in at.code)
    at.selectbox(key="export_fmt").set_value("vllm").run()
    assert any("cannot be served by vLLM" in e.value and BLOCK1 in e.value for e in at.error)
    # the switch turned off with the block's experts differing: the plan no longer resolves, and the page says why
    at.checkbox(key=f"plan_pe_{moe.id}_mixed").uncheck().run()
    assert not at.exception
    assert any(f"the experts of {BLOCK1} mix schemes" in e.value for e in at.error)


def test_without_experts_one_by_one_an_experts_edit_sets_the_whole_block(moe):
    at = _plans_page(moe.id)
    at.selectbox(key=f"plan_default_{moe.id}_{NEW}").set_value("FP8_DYNAMIC").run()
    _set_row(at, moe.id, f"{BLOCK1}.2.up_proj", "W4A16")
    table = _table(at).set_index("layer")
    assert set(table.index[table["scheme"] == "W4A16"]) == {f"{BLOCK1}.{e}.{p}" for e in range(4) for p in PROJS}
    assert table.loc["model.layers.0.mlp.experts.2.up_proj", "scheme"] == "FP8_DYNAMIC"
    assert any(f"W4A16 set on every routed expert of {BLOCK1}" in i.value for i in at.info)
    assert not at.error and not at.checkbox(key=f"plan_pe_{moe.id}_{NEW}").value
    # the whole-block plan's rows read their experts' KLs where only a per-expert sweep of W4A16 was made
    assert _table(at).set_index("layer")["sensitivity_kl"].loc[f"{BLOCK1}.2.up_proj"] > 0
