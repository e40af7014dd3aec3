"""The service layer's kept answers (app.services.resolve, quantcore.schemes.specs' grouping of layer names): the same
as computing them again, never shared with the caller, and never handed to another model or plan body."""

from __future__ import annotations

import datetime as dt

from app import services as svc
from quantcore.schemes.specs import expert_blocks, fusion_group_of, fusion_groups, get_scheme, plan_unit_of
from store.records import ModelRecord, ScoreRecord


def _model(linears: list[dict], model_id: int = 1) -> ModelRecord:
    return ModelRecord(id=model_id, name="m", sha256="0" * 64, source_kind="folder", source_name="m", path="-",
                       architecture="-", model_type="-", num_layers=1, num_params=0, dtype="bfloat16",
                       hidden_size=None, vocab_size=None, total_bytes=0, summary={"linears": linears},
                       created_at=dt.datetime.now(dt.UTC))


def _linears(k: int) -> list[dict]:
    return [{"name": f"model.layers.0.self_attn.{p}_proj", "out_features": 64, "in_features": k} for p in "qkvo"]


def test_resolve_keeps_an_answer_per_model_and_body_and_hands_out_copies() -> None:
    model = _model(_linears(64))
    first, problem = svc.resolve(model, {"default": "W4A16_G64"})
    assert problem is None and set(first.values()) == {get_scheme("W4A16_G64")}
    first["model.layers.0.self_attn.q_proj"] = "changed by the caller"
    again, _ = svc.resolve(model, {"default": "W4A16_G64"})
    assert again == svc._resolve(model, {"default": "W4A16_G64"})[0]  # the caller's change did not reach it
    other, _ = svc.resolve(model, {"default": "FP8_DYNAMIC"})
    assert set(other.values()) == {get_scheme("FP8_DYNAMIC")}
    # the same row id with other layers (a database started again) is another model
    renamed = _model([{**lin, "name": lin["name"].replace("layers.0", "layers.1")} for lin in _linears(64)])
    assert set(svc.resolve(renamed, {"default": "W4A16_G64"})[0]) == {lin["name"] for lin in renamed.linears}
    # a problem is kept as a problem
    bad = {"default": "W4A16_G64", "layers": {"nope": "BF16"}}
    assert svc.resolve(model, bad)[0] is None and svc.resolve(model, bad)[1] == svc._resolve(model, bad)[1]


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
    resolved, problem = svc.resolve(model, body)
    assert resolved is None
    assert problem.startswith("This plan file is malformed: 'kv_cache': unknown KV cache format 'FP7'")
    assert "unknown scheme 'INT9'" in problem and "'nope'" in problem
    _, alone = svc.resolve(model, {"default": "BF16", "kv_cache": "FP7"})  # nothing else wrong: the one problem
    assert "\n" not in alone and "FP7" in alone


def test_an_unsmoothed_fix_takes_the_layers_own_alpha_with_it() -> None:
    """A per-layer alpha would smooth INT8_W8A8 again: the fix that swaps SmoothQuant out of o_proj drops it (and
    only there); without clear_alpha the alphas stay."""
    model = _model(_linears(64), model_id=8)
    o_proj = "model.layers.0.self_attn.o_proj"
    qkv = {f"model.layers.0.self_attn.{p}_proj": {"smoothquant_alpha": 0.6} for p in "qkv"}
    body = {"default": "INT8_W8A8_SQ", "layers": {o_proj: {"smoothquant_alpha": 0.7}, **qkv}}
    assert svc.unsmoothed_fixes(model, body) == {"INT8_W8A8": [o_proj]}
    fixed = svc.with_schemes(model, body, svc.unsmoothed_fixes(model, body), clear_alpha=True)
    assert fixed["layers"] == {o_proj: "INT8_W8A8", **qkv}
    resolved, problem = svc.resolve(model, fixed)
    assert problem is None and resolved[o_proj].smoothquant_alpha is None
    assert resolved["model.layers.0.self_attn.q_proj"].smoothquant_alpha == 0.6
    assert svc.unsmoothed_fixes(model, fixed) == {}
    kept = svc.with_schemes(model, body, {"INT8_W8A8": [o_proj]})
    assert kept["layers"][o_proj] == {"scheme": "INT8_W8A8", "smoothquant_alpha": 0.7}
    assert svc.resolve(model, kept)[0][o_proj].smoothquant_alpha == 0.7  # smoothed again: why the fix clears it


def test_a_malformed_plan_file_is_said_once() -> None:
    """A plan file malformed elsewhere than its serving fields (rules not a list) is said once, whether or not it also
    names a KV cache."""
    model = _model(_linears(64), model_id=9)
    for body in ({"default": "BF16", "kv_cache": "AUTO", "rules": "oops"},
                 {"default": "BF16", "kv_cache": "FP7", "rules": "oops"}):
        _, problem = svc.resolve(model, body)
        assert problem.count("This plan file is malformed") == 1 and "'rules'" in problem


def _score(job_id: int, counts: list[int]) -> ScoreRecord:
    edges = [0.0, *[10.0 ** e for e in range(-6, 3)]]  # 0, 1e-6 … 100: the stored bins, most of them empty
    return ScoreRecord(id=job_id, job_id=job_id, model_id=1, plan_id=None, plan_label=f"P{job_id}", plan_body={},
                       dataset="t", tokens=sum(counts), kl_mean=0.1, kl_p50=0.1, kl_p90=0.1, kl_p99=0.1, kl_max=0.1,
                       top1_agree=0.9, ppl_ref=1.0, ppl=1.0, predicted_kl=None,
                       details={"kl_hist": {"edges": edges, "counts": counts}})


def test_the_kl_histogram_spans_the_bins_that_hold_tokens_with_one_empty_bin_each_side() -> None:
    a = _score(1, [0, 0, 0, 5, 5, 0, 0, 0, 0])  # tokens in bins 3-4 (1e-4 … 1e-2)
    b = _score(2, [0, 0, 0, 0, 2, 8, 0, 0, 0])  # bins 4-5
    hist, _ = svc.score_frames([a, b])
    assert hist["label"].nunique() == 2
    for _, part in hist.groupby("label"):
        assert len(part) == 5  # bins 2-6: 3-5 occupied between both scores, one empty each side
        assert part["share"].iloc[0] == 0 and part["share"].iloc[-1] == 0
        assert abs(part["share"].sum() - 1) < 1e-12
    assert hist["center"].max() < 1  # not out to the stored last edge of 100 nats
    edge, _ = svc.score_frames([_score(3, [4, 0, 0, 0, 0, 0, 0, 0, 6])])  # occupied at both ends: nothing to trim
    assert len(edge) == 9


def test_a_case_with_no_time_says_why_only_where_the_device_runs_the_path() -> None:
    ms = [0.5, None, None, None, float("nan")]
    why = [None, "over budget: ~20 s needed, 10 s left of 60 s for shape N=1 K=1", "failed on cuda: bad shape",
           "not supported on cpu: no FP4 unit", None]
    # timed; over the budget; refused by the kernel; not run at all (n/a, the chart's default); no reason kept
    assert svc.no_time_notes(ms, why) == ["", "skipped", "failed", "", ""]


def test_uploads_and_paths_the_app_refuses_before_any_job(qp_settings, monkeypatch, tmp_path) -> None:
    """A pickle checkpoint, a file of no upload kind, an upload over the limit, a relative or missing path: each
    refused with what to do instead, nothing queued or staged. A folder that exists is queued for a worker."""
    import pytest

    from store.settings import get_settings

    for name in ("pytorch_model.bin", "model.pt", "ckpt.pth", "weights.pkl"):
        with pytest.raises(ValueError, match=f"{name} is a pickle checkpoint; quantplan never unpickles uploads. "
                                             r"Save the model with save_pretrained\(safe_serialization=True\)"):
            svc.register_upload(name, b"\x80\x04")
    with pytest.raises(ValueError, match=r"model.safetensors: upload a .zip or .tar.gz of a Hugging Face folder"):
        svc.register_upload("model.safetensors", b"{}")
    with pytest.raises(ValueError, match="give an absolute path"):
        svc.register_path("models/llama")
    with pytest.raises(ValueError, match="does not exist"):
        svc.register_path(str(tmp_path / "nowhere"))
    monkeypatch.setenv("QUANTPLAN_UPLOAD_LIMIT_MB", "1")
    get_settings.cache_clear()
    with pytest.raises(ValueError, match=r"big.zip is 2 MiB, over the 1 MiB limit"):
        svc.register_upload("big.zip", b"PK\x03\x04" + bytes(2 * 1024 * 1024))
    assert svc.list_jobs() == []
    assert not (qp_settings.artifact_dir / "uploads").exists() or not any((qp_settings.artifact_dir / "uploads").iterdir())
    (tmp_path / "folder").mkdir()
    job = svc.register_path(str(tmp_path / "folder"), name="mine")
    assert (job.kind, job.params["source"], job.params["name"]) == ("register", str(tmp_path / "folder"), "mine")


def test_an_upload_whose_bytes_are_not_what_its_name_says_is_refused_at_once(qp_settings) -> None:
    import io
    import tarfile
    import zipfile

    import pytest

    noise = bytes(range(256)) * 8
    for name, kind in (("model.zip", "zip archive"), ("model.tar.gz", "tar archive"), ("model.tgz", "tar archive"),
                       ("model.tar", "tar archive"), ("model.gguf", "GGUF file")):
        with pytest.raises(ValueError, match=f"model.* is not a {kind} .*nothing was queued"):
            svc.register_upload(name, noise)
    assert svc.list_jobs() == []  # nothing queued, nothing staged
    assert not (qp_settings.artifact_dir / "uploads").exists() or not any((qp_settings.artifact_dir / "uploads").iterdir())
    # real archives pass the check (the worker validates their contents)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("config.json", "{}")
    assert svc._upload_kind_mismatch("m.zip", buf.getvalue()) is None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("config.json")
        info.size = 2
        t.addfile(info, io.BytesIO(b"{}"))
    assert svc._upload_kind_mismatch("m.tar.gz", buf.getvalue()) is None
    assert svc._upload_kind_mismatch("m.gguf", b"GGUF\x03\x00\x00\x00") is None
