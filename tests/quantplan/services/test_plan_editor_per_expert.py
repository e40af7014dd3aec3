"""The Plans page's editing of a per-expert plan (issue 43, item 4; quantplan.services.plan_editor): with the plan's
``per_expert: true`` a scheme set on one expert's layer sets that expert's gate/up/down only (quantcore's
fusion_units with per_expert), without it every routed expert of the block; the layer table's "fused with" counts
that unit, and its sensitivity column reads the expert's own KL from a per-expert sweep in a per-expert plan and the
block's from a whole-block sweep otherwise."""

from __future__ import annotations

import pandas as pd
import pytest

from quantcore.planning.plans import group_label
from quantcore.schemes.fusion import expert_parts
from quantplan.services import plan_editor as plan_editor_svc
from quantplan.services import plans as plans_svc

BLOCKS, EXPERTS = 2, 4
BLOCK1 = "model.layers.1.mlp.experts"


def _linears() -> list[dict]:
    """The linears of tests/factories.py's tiny Qwen3-MoE once its experts are split (hidden 64, experts' 32)."""
    out = []
    for b in range(BLOCKS):
        out += [{"name": f"model.layers.{b}.self_attn.{p}_proj", "in_features": 64, "out_features": 64}
                for p in "qkvo"]
        out += [{"name": f"model.layers.{b}.mlp.experts.{e}.{p}", "in_features": k, "out_features": n}
                for e in range(EXPERTS)
                for p, (n, k) in {"gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}.items()]
    return out + [{"name": "lm_head", "in_features": 64, "out_features": 1000}]


@pytest.fixture
def moe(qp_settings):
    from quantplan.services import models as models_svc
    from store import repo
    from store.db import session_scope

    summary = {"architecture": "Qwen3MoeForCausalLM", "model_type": "qwen3_moe", "num_layers": BLOCKS,
               "num_params": 1_000_000, "dtype": "float32", "total_bytes": 4_000_000, "linears": _linears(),
               "moe": {"experts": EXPERTS, "top_k": 2,
                       "blocks": [f"model.layers.{b}.mlp.experts" for b in range(BLOCKS)]}, "unsplit_experts": []}
    with session_scope(qp_settings) as s:
        model = repo.add_model(s, name="moe", sha256="ef" * 32, source_kind="folder", source_name="moe",
                               path="models/z", summary=summary, user="tester")
    return models_svc.get_model(model.id)


def _sweep(model, scheme: str, units: list[list[str]], kl) -> None:
    """A stored sweep of ``scheme`` over ``units`` as the sensitivity job stores one (its unit labelled as
    quantcore.evaluation.sensitivity labels it), unit i's KL ``kl(i)``."""
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        job = repo.create_job(s, kind="sensitivity", params={"scheme": scheme}, queue="cpu", user=None,
                              model_id=model.id)
        repo.save_sensitivity(s, job_id=job.id, model_id=model.id, scheme=scheme,
                              rows=[{"layer": group_label(u), "layers": u, "kl_mean": kl(i), "top1_agree": 0.9}
                                    for i, u in enumerate(units)])
        repo.finish_job(s, job.id, status="succeeded", result={"units": len(units), "scheme": scheme})


def test_an_experts_edit_sets_its_own_layers_in_a_per_expert_plan_and_the_block_otherwise(moe) -> None:
    layer = f"{BLOCK1}.2.up_proj"
    expert = [f"{BLOCK1}.2.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    whole, block = plan_editor_svc.with_layer_scheme(moe, {"default": "FP8_DYNAMIC"}, layer, "W4A16")
    assert len(block) == EXPERTS * 3 and set(whole["layers"]) == set(block) and set(expert) < set(block)
    assert "per_expert" not in whole and plans_svc.resolve(moe, whole)[1] is None

    body, unit = plan_editor_svc.with_layer_scheme(moe, {"default": "FP8_DYNAMIC", "per_expert": True}, layer,
                                                   "W4A16")
    assert unit == expert and set(body["layers"]) == set(expert) and body["per_expert"] is True
    resolved, problem = plans_svc.resolve(moe, body)
    assert problem is None
    assert {n for n, s in resolved.items() if s.name == "W4A16"} == set(expert)
    assert resolved[f"{BLOCK1}.3.up_proj"].name == "FP8_DYNAMIC"
    # the same body without per_expert mixes the block: refused, naming the key that allows it
    mixed, problem = plans_svc.resolve(moe, {k: v for k, v in body.items() if k != "per_expert"})
    assert mixed is None and f"the experts of {BLOCK1} mix schemes" in problem and "per_expert: true" in problem
    # a fix offered on the page (with_schemes) keeps to the per-expert unit too
    fixed = plan_editor_svc.with_schemes(moe, body, {"NVFP4": [f"{BLOCK1}.0.down_proj"]})
    assert {n for n, s in fixed["layers"].items() if s == "NVFP4"} == {f"{BLOCK1}.0.{p}" for p in
                                                                       ("gate_proj", "up_proj", "down_proj")}


def test_the_layer_table_counts_the_plans_unit_and_reads_the_sweep_of_that_unit(moe) -> None:
    names = [lin["name"] for lin in _linears()]
    block_units = [[n for n in names if n.startswith(f"model.layers.{b}.mlp.experts.")] for b in range(BLOCKS)]
    expert_units = [part for u in block_units for part in expert_parts(u)]
    # W4A16: a whole-block sweep (KL 1, 2 by block) and a per-expert one (KL 0.01 x (unit + 1)), made after it
    _sweep(moe, "W4A16", block_units, lambda i: float(i + 1))
    _sweep(moe, "W4A16", expert_units, lambda i: 0.01 * (i + 1))
    row = f"{BLOCK1}.2.down_proj"  # expert unit 4 + 2: KL 0.07
    whole = plan_editor_svc.layer_table(moe, {"default": "W4A16"}, "h100").set_index("layer")
    assert whole.loc[row, "fused_with"] == EXPERTS * 3 - 1
    assert whole.loc[row, "sensitivity_kl"] == pytest.approx(2.0)  # the block's, though the expert's came later
    apart = plan_editor_svc.layer_table(moe, {"default": "W4A16", "per_expert": True}, "h100").set_index("layer")
    assert apart.loc[row, "fused_with"] == 2 and apart.loc["model.layers.1.self_attn.q_proj", "fused_with"] == 2
    assert apart.loc[row, "sensitivity_kl"] == pytest.approx(0.07)
    assert apart.loc[f"{BLOCK1}.2.gate_proj", "sensitivity_kl"] == pytest.approx(0.07)
    assert apart.loc["model.layers.0.mlp.experts.0.up_proj", "sensitivity_kl"] == pytest.approx(0.01)
    # only a per-expert sweep of a scheme: a whole-block plan's rows read their experts' KLs rather than none
    _sweep(moe, "NVFP4", expert_units, lambda i: 0.1 * (i + 1))
    only = plan_editor_svc.layer_table(moe, {"default": "NVFP4"}, "h100").set_index("layer")
    assert only.loc[row, "sensitivity_kl"] == pytest.approx(0.7)
    assert pd.isna(only.loc["model.layers.0.self_attn.q_proj", "sensitivity_kl"])  # not swept in NVFP4
