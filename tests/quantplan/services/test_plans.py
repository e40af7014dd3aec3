"""Resolving a plan on a model (quantplan.services.plans.resolve) and quantcore.schemes' grouping of layer names:
the kept answers are the same as computing them again, never shared with the caller, never handed to another model
or plan body; and a plan file's problems are said together, once each."""

from __future__ import annotations

import datetime as dt

from quantcore.schemes.fusion import expert_blocks, fusion_group_of, fusion_groups, plan_unit_of
from quantcore.schemes.presets import get_scheme
from quantplan.services import plans as plans_svc
from store.records import ModelRecord


def _model(linears: list[dict], model_id: int = 1) -> ModelRecord:
    return ModelRecord(id=model_id, name="m", sha256="0" * 64, source_kind="folder", source_name="m", path="-",
                       architecture="-", model_type="-", num_layers=1, num_params=0, dtype="bfloat16",
                       hidden_size=None, vocab_size=None, total_bytes=0, summary={"linears": linears},
                       created_at=dt.datetime.now(dt.UTC))


def _linears(k: int) -> list[dict]:
    return [{"name": f"model.layers.0.self_attn.{p}_proj", "out_features": 64, "in_features": k} for p in "qkvo"]


def test_resolve_keeps_an_answer_per_model_and_body_and_hands_out_copies() -> None:
    model = _model(_linears(64))
    first, problem = plans_svc.resolve(model, {"default": "W4A16_G64"})
    assert problem is None and set(first.values()) == {get_scheme("W4A16_G64")}
    first["model.layers.0.self_attn.q_proj"] = "changed by the caller"
    again, _ = plans_svc.resolve(model, {"default": "W4A16_G64"})
    assert again == plans_svc._resolve(model, {"default": "W4A16_G64"})[0]  # the caller's change did not reach it
    other, _ = plans_svc.resolve(model, {"default": "FP8_DYNAMIC"})
    assert set(other.values()) == {get_scheme("FP8_DYNAMIC")}
    # the same row id with other layers (a database started again) is another model
    renamed = _model([{**lin, "name": lin["name"].replace("layers.0", "layers.1")} for lin in _linears(64)])
    assert set(plans_svc.resolve(renamed, {"default": "W4A16_G64"})[0]) == {lin["name"] for lin in renamed.linears}
    # a problem is kept as a problem
    bad = {"default": "W4A16_G64", "layers": {"nope": "BF16"}}
    assert plans_svc.resolve(model, bad)[0] is None
    assert plans_svc.resolve(model, bad)[1] == plans_svc._resolve(model, bad)[1]


def test_kept_layer_groupings_are_fresh_lists() -> None:
    names = [lin["name"] for lin in _linears(64)]
    groups = fusion_groups(names)
    groups[0].append("x")
    assert fusion_groups(names) == [names[:3]]
    assert fusion_group_of(names[1], names) == names[:3] and fusion_group_of(names[3], names) == [names[3]]
    # a name from elsewhere still finds the group it would join
    assert fusion_group_of("model.layers.0.self_attn.v_proj", names[:2]) == names[:3]
    experts = [f"b.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    blocks = expert_blocks(experts)
    blocks["b.mlp.experts"].clear()
    assert expert_blocks(experts) == {"b.mlp.experts": experts}
    assert plan_unit_of(experts[4], experts) == experts


def test_a_bad_serving_field_does_not_hide_the_plans_other_problems() -> None:
    """An unknown KV cache format is said together with what the layers' schemes run into (an unknown scheme, a
    rule matching nothing, a layer the model lacks), not alone first and the rest after it is mended."""
    model = _model(_linears(64), model_id=7)
    body = {"default": "BF16", "kv_cache": "FP7", "rules": [{"match": "q_proj", "scheme": "INT9"}],
            "layers": {"nope": "FP8_DYNAMIC"}}
    resolved, problem = plans_svc.resolve(model, body)
    assert resolved is None
    assert problem.startswith("This plan file is malformed: 'kv_cache': unknown KV cache format 'FP7'")
    assert "unknown scheme 'INT9'" in problem and "'nope'" in problem
    _, alone = plans_svc.resolve(model, {"default": "BF16", "kv_cache": "FP7"})  # nothing else wrong: the one problem
    assert "\n" not in alone and "FP7" in alone


def test_a_malformed_plan_file_is_said_once() -> None:
    """A plan file malformed elsewhere than its serving fields (rules not a list) is said once, whether or not it also
    names a KV cache."""
    model = _model(_linears(64), model_id=9)
    for body in ({"default": "BF16", "kv_cache": "AUTO", "rules": "oops"},
                 {"default": "BF16", "kv_cache": "FP7", "rules": "oops"}):
        _, problem = plans_svc.resolve(model, body)
        assert problem.count("This plan file is malformed") == 1 and "'rules'" in problem
