"""The Plans page's editing use cases (quantplan.services.plan_editor): the fixes it offers and what they change."""

from __future__ import annotations

import datetime as dt

from quantplan.services import plan_editor as plan_editor_svc
from quantplan.services import plans as plans_svc
from store.records import ModelRecord


def _model(linears: list[dict], model_id: int = 1) -> ModelRecord:
    return ModelRecord(id=model_id, name="m", sha256="0" * 64, source_kind="folder", source_name="m", path="-",
                       architecture="-", model_type="-", num_layers=1, num_params=0, dtype="bfloat16",
                       hidden_size=None, vocab_size=None, total_bytes=0, summary={"linears": linears},
                       created_at=dt.datetime.now(dt.UTC))


def _linears(k: int) -> list[dict]:
    return [{"name": f"model.layers.0.self_attn.{p}_proj", "out_features": 64, "in_features": k} for p in "qkvo"]


def test_an_unsmoothed_fix_takes_the_layers_own_alpha_with_it() -> None:
    """A per-layer alpha would smooth INT8_W8A8 again: the fix that swaps SmoothQuant out of o_proj drops it (and
    only there); without clear_alpha the alphas stay."""
    model = _model(_linears(64), model_id=8)
    o_proj = "model.layers.0.self_attn.o_proj"
    qkv = {f"model.layers.0.self_attn.{p}_proj": {"smoothquant_alpha": 0.6} for p in "qkv"}
    body = {"default": "INT8_W8A8_SQ", "layers": {o_proj: {"smoothquant_alpha": 0.7}, **qkv}}
    assert plan_editor_svc.unsmoothed_fixes(model, body) == {"INT8_W8A8": [o_proj]}
    fixed = plan_editor_svc.with_schemes(model, body, plan_editor_svc.unsmoothed_fixes(model, body), clear_alpha=True)
    assert fixed["layers"] == {o_proj: "INT8_W8A8", **qkv}
    resolved, problem = plans_svc.resolve(model, fixed)
    assert problem is None and resolved[o_proj].smoothquant_alpha is None
    assert resolved["model.layers.0.self_attn.q_proj"].smoothquant_alpha == 0.6
    assert plan_editor_svc.unsmoothed_fixes(model, fixed) == {}
    kept = plan_editor_svc.with_schemes(model, body, {"INT8_W8A8": [o_proj]})
    assert kept["layers"][o_proj] == {"scheme": "INT8_W8A8", "smoothquant_alpha": 0.7}
    assert plans_svc.resolve(model, kept)[0][o_proj].smoothquant_alpha == 0.7  # smoothed again: why the fix clears it
