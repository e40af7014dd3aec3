"""An MoE model's calibration shows per-expert token counts (issue 43): `quantplan calibrate` stores how many
calibration tokens the router sent to each expert with the job, prints how many experts fall short, and the
Outliers page's chart outlines them."""

from __future__ import annotations

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json


def test_an_moe_calibration_shows_how_many_tokens_each_expert_was_routed(qp_settings, capsys, tmp_path):
    from app.charts import moe as moe_charts
    from quantplan.services import jobs as jobs_svc
    from tests.factories import save_tiny_moe

    folder = save_tiny_moe(tmp_path / "moe", num_experts=16, num_experts_per_tok=1)
    run_json(capsys, "models", "add", str(folder), "--name", "moe", "--json")
    cal = run_json(capsys, "calibrate", "moe", "--local", "--samples", "2", "--seq-len", "8", "--json")
    experts = cal["experts"]
    assert set(experts) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    for rec in experts.values():  # 16 tokens, one expert each
        assert rec["tokens"] == 16 and rec["top_k"] == 1 and len(rec["counts"]) == 16
        assert sum(rec["counts"]) == 16 and len(rec["weight"]) == 16
    assert jobs_svc.get_job(cal["job"]).result["experts"] == experts  # stored with the calibration

    code, out, _ = run(capsys, "calibrate", "moe", "--local", "--samples", "1", "--seq-len", "4")
    assert code == 0 and "MoE: 32 of 32 experts were routed fewer than 32 calibration tokens" in out

    frame = moe_charts.coverage_frame(experts)
    assert len(frame) == 32 and frame["thin"].all()
    spec = moe_charts.coverage_chart(frame).to_dict()
    assert len(spec["layer"]) == 2  # the cells and the outlines of the thin experts


def test_a_dense_calibration_has_no_expert_record(tiny_model, capsys):
    cal = run_json(capsys, "calibrate", "tiny", "--local", "--samples", "1", "--seq-len", "8", "--json")
    assert "experts" not in cal


def test_a_per_expert_sweep_reports_each_expert_as_its_own_unit(qp_settings, capsys, tmp_path):
    """`sensitivity --per-expert`, exact and estimated: one unit per routed expert (its gate/up/down), where the
    plain sweep has one unit for the whole block; the two methods cover the same units."""
    from tests.factories import save_tiny_moe

    folder = save_tiny_moe(tmp_path / "moe", num_experts=4, num_experts_per_tok=2)
    run_json(capsys, "models", "add", str(folder), "--name", "moe", "--json")
    base = ("sensitivity", "moe", "--scheme", "INT8_W8A8", "--local", "--samples", "2", "--seq-len", "8", "--json")
    whole = run_json(capsys, *base)
    apart = run_json(capsys, *base, "--per-expert")
    fisher = run_json(capsys, *base, "--per-expert", "--method", "fisher", "--no-compare")
    expert_units = [r for r in apart["layers"] if ".experts." in r["layer"]]
    assert len(expert_units) == 2 * 4  # two blocks of four experts
    assert all(len(r["layers"]) == 3 for r in expert_units)  # one expert's gate, up and down
    assert len(apart["layers"]) == len(whole["layers"]) + 2 * (4 - 1)
    assert {r["layer"] for r in fisher["layers"]} == {r["layer"] for r in apart["layers"]}
    code, _, err = run(capsys, *base, "--per-expert", "--no-groups")
    assert code != 0 and "--per-expert sweeps each expert's gate/up/down" in err
