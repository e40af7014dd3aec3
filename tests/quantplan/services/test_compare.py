"""Comparing runs (quantplan.services.compare): parameters side by side, paired differences of scores on the same
tokens, per-layer views, and outlier drift between a tiny base model and its fine-tune, calibrated for real."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jobs.client import create_local_job
from jobs.specs import CalibrateSpec, ScoreSpec
from quantplan.services import compare
from quantplan.services.errors import Refused
from store import repo
from store.db import session_scope
from tests.factories import save_tiny_llama, stored_model

MOVED_FROM, MOVED_TO = 3, 11  # the hidden channel whose q/k/v input outlier the fine-tune moves
GROWN = 7  # the down_proj input channel whose outlier the fine-tune grows
GAIN = 20.0


@pytest.fixture
def run_body(qp_settings):
    """Run one job body in this process through the runner; the job as it ended."""
    from worker.bodies import body_for, shared
    from worker.runner import run_job

    shared._MODEL_CACHE.clear()

    def run(kind, params, *, model_id=None):
        job = create_local_job(kind, params, model_id=model_id, settings=qp_settings)
        run_job(job.id, body_for(kind), settings=qp_settings)
        with session_scope(qp_settings) as s:
            return repo.get_job(s, job.id)

    return run


def _base_and_fine_tune(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny Llama with planted outliers (q/k/v input channel 3, down_proj input channel 7) and a "fine-tune": its
    copy with every weight perturbed, the q/k/v outlier moved to channel 11 and the down_proj one grown 4x."""
    import torch
    from transformers import LlamaForCausalLM

    base_dir = save_tiny_llama(tmp_path / "base")
    model = LlamaForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[MOVED_FROM] = GAIN
            layer.mlp.up_proj.weight[GROWN] *= 30.0
    model.save_pretrained(base_dir)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.002 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            layer.input_layernorm.weight[MOVED_FROM] = 1.0
            layer.input_layernorm.weight[MOVED_TO] = GAIN
            layer.mlp.up_proj.weight[GROWN] *= 4.0
    tuned_dir = tmp_path / "tuned"
    model.save_pretrained(tuned_dir)
    for f in base_dir.iterdir():  # the tokenizer files
        if "token" in f.name:
            (tuned_dir / f.name).write_bytes(f.read_bytes())
    return base_dir, tuned_dir


@pytest.fixture
def pair(run_body, tmp_path):
    """(base model id, fine-tune model id, base calibration job, fine-tune calibration job), calibrated for real."""
    base_dir, tuned_dir = _base_and_fine_tune(tmp_path)
    ids = []
    for folder, name in ((base_dir, "base"), (tuned_dir, "tuned")):
        job = run_body("register", {"source": str(folder), "name": name})
        assert job.status == "succeeded", job.error
        ids.append(job.result["model_id"])
    cals = [run_body("calibrate", CalibrateSpec(samples=4, seq_len=16), model_id=m) for m in ids]
    assert all(c.status == "succeeded" for c in cals), [c.error for c in cals]
    return ids[0], ids[1], cals[0], cals[1]


def _job(s, model_id, kind="score", params=None, status="succeeded", **fields):
    job = repo.create_job(s, kind=kind, params=params or {}, queue="cpu", user="ann", model_id=model_id)
    repo.mark_running(s, job.id, worker_host="box", device="cpu", torch_version="2.x")
    repo.finish_job(s, job.id, status=status, result=fields.get("result"))
    return job


def _score(s, model_id, label, kl_seq, *, eval_key="k1", dataset="builtin:lee.cor", tokens=600, per_seq=True):
    from quantcore.evaluation.statistics import block_mean

    job = _job(s, model_id, params={"scheme": label})
    est = block_mean(np.asarray(kl_seq)[:, None])
    report = {"kl_mean": est.value, "kl_p50": 0.0, "kl_p90": 0.0, "kl_p99": 0.0, "kl_max": 1.0, "top1_agree": 0.9,
              "ppl_ref": 10.0, "ppl": 10.5, "tokens": tokens, "kl_mean_err": est.err, "sequences": len(kl_seq),
              "eval_key": eval_key}
    if per_seq:
        report["kl_by_sequence"] = list(map(float, kl_seq))
    repo.save_score(s, job_id=job.id, model_id=model_id, plan_id=None, plan_label=label,
                    plan_body={"default": label}, dataset=dataset, report=report)
    return job


def test_fewer_than_two_runs_or_unknown_ids_are_refused_saying_so(qp_settings):
    with session_scope() as s:
        job = _job(s, stored_model(s).id)
    with pytest.raises(Refused, match=rf"two or more runs \(job ids\); got 1 \(#{job.id}\)"):
        compare.compare_runs([job.id, job.id])
    with pytest.raises(Refused, match=r"no job #98, #99: the Jobs page"):
        compare.compare_runs([job.id, 98, 99])
    with pytest.raises(Refused, match=r"'x2' is not a job id"):
        compare.parse_job_ids("3, x2")
    assert compare.parse_job_ids("#3, 5 7,,3") == [3, 5, 7]
    with session_scope() as s:
        other = _job(s, job.model_id, params={"scheme": "INT8"})
    with pytest.raises(Refused, match=rf"baseline #1234 is not among the runs compared \(#{job.id}, #{other.id}\)"):
        compare.compare_runs([job.id, other.id], baseline=1234)
    assert compare.compare_runs([job.id, other.id], baseline=other.id).baseline == f"#{other.id}"


def test_parameters_side_by_side_mark_the_rows_that_differ(qp_settings):
    with session_scope() as s:
        model = stored_model(s)
        a = _job(s, model.id, params={"scheme": "FP8_DYNAMIC", "samples": 16, "opts": {"seq_len": 256}})
        b = _job(s, model.id, params={"scheme": "INT8_W8A8", "samples": 16, "opts": {"seq_len": 512}})
    c = compare.compare_runs([a.id, b.id])
    rows = {r["parameter"]: r for r in c.parameters}
    assert rows["params.scheme"] == {"parameter": "params.scheme", f"#{a.id}": "FP8_DYNAMIC",
                                     f"#{b.id}": "INT8_W8A8", "differs": True}
    assert rows["params.opts.seq_len"]["differs"] and not rows["params.samples"]["differs"]
    assert rows["model"][f"#{a.id}"] == "tiny" and not rows["model"]["differs"]
    assert rows["requested by"][f"#{b.id}"] == "ann" and rows["device"][f"#{a.id}"] == "cpu"
    assert c.baseline == f"#{a.id}" and c.keys == [f"#{a.id}", f"#{b.id}"]
    assert "fewer than two scores" in c.notes["differences"][0]


def test_scores_on_the_same_tokens_pair_sequence_by_sequence_sharper_than_unpaired(qp_settings):
    rng = np.random.default_rng(0)
    hard = rng.lognormal(-4, 1.0, 24)  # the passages' own difficulty, shared by both plans
    kl_a = hard * 1.10 + rng.normal(0, 1e-4, 24)
    kl_b = hard * 1.00 + rng.normal(0, 1e-4, 24)
    with session_scope() as s:
        model = stored_model(s)
        a = _score(s, model.id, "A", kl_a)
        b = _score(s, model.id, "B", kl_b)
        old = _score(s, model.id, "OLD", kl_b, per_seq=False)  # stored before per-sequence means were kept
        other = _score(s, model.id, "OTHER", kl_b, dataset="mine.txt")
    c = compare.compare_runs([b.id, a.id, old.id, other.id])
    kl = {r["a"]: r for r in c.differences if r["figure"] == "KL"}
    d = kl_a - kl_b
    assert kl[f"#{a.id}"]["paired"] and kl[f"#{a.id}"]["b"] == f"#{b.id}"
    assert kl[f"#{a.id}"]["difference"] == pytest.approx(d.mean())
    assert kl[f"#{a.id}"]["err"] == pytest.approx(d.std(ddof=1) / np.sqrt(24))
    assert kl[f"#{a.id}"]["err"] < kl[f"#{a.id}"]["err_unpaired"] / 5  # shared noise cancels
    assert "is better by" in kl[f"#{a.id}"]["verdict"] and "paired over 24 sequences" in kl[f"#{a.id}"]["why"]
    assert not kl[f"#{old.id}"]["paired"] and kl[f"#{old.id}"]["difference"] == pytest.approx(0.0, abs=1e-12)
    assert f"#{old.id} kept no per-sequence values (kl_by_sequence" in kl[f"#{old.id}"]["why"]
    assert f"#{other.id}" not in kl  # other tokens: side by side only, said why
    assert any(f"#{other.id} was scored on other tokens (mine.txt" in n for n in c.notes["differences"])
    metrics = {r["metric"]: r for r in c.metrics}
    assert metrics["kl_mean"][f"#{a.id}"] == pytest.approx(kl_a.mean())


def test_per_unit_sensitivity_of_two_sweeps_side_by_side_with_their_rank_correlation(qp_settings):
    with session_scope() as s:
        model = stored_model(s)
        jobs = []
        for kls in ((0.01, 0.02, 0.03, 0.04), (0.06, 0.03, 0.09, 0.12)):  # the second swaps u0 and u1
            j = _job(s, model.id, kind="sensitivity", params={"scheme": "INT8"})
            repo.save_sensitivity(s, job_id=j.id, model_id=model.id, scheme="INT8",
                                  rows=[{"layer": f"u{i}", "kl_mean": kl, "top1_agree": 0.9}
                                        for i, kl in enumerate(kls)])
            jobs.append(j)
    c = compare.compare_runs([j.id for j in jobs])
    rows = {r["unit"]: r for r in c.sensitivity}
    assert rows["u3"][f"#{jobs[1].id}"] == pytest.approx(0.12) and rows["u3"]["differs"]
    (rank,) = c.rank_correlation  # ranks 0 1 2 3 against 1 0 2 3: 1 - 6 * 2 / (4 * 15)
    assert rank == {"a": f"#{jobs[1].id}", "b": f"#{jobs[0].id}", "units": 4, "spearman": pytest.approx(0.8)}
    assert {r["metric"]: r for r in c.metrics}["most sensitive unit"][f"#{jobs[0].id}"] == "u3"


def test_real_scores_of_two_plans_pair_and_show_their_per_layer_schemes(run_body, pair):
    base, tuned, _, _ = pair
    tokens = {"samples": 3, "seq_len": 16, "cal_samples": 2, "cal_seq_len": 16}
    a = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", **tokens), model_id=base)
    b = run_body("score", ScoreSpec(scheme="INT8_W8A8_SQ", **tokens), model_id=base)
    t = run_body("score", ScoreSpec(scheme="FP8_DYNAMIC", **tokens), model_id=tuned)
    assert a.status == b.status == t.status == "succeeded", (a.error, b.error, t.error)
    c = compare.compare_runs([a.id, b.id, t.id])
    kl, kl_tuned = [r for r in c.differences if r["figure"] == "KL"]
    # the fine-tune shares the tokenizer: its score pairs with the base's over the same tokens, each KL against
    # its own model's reference, which a note says
    assert kl_tuned["a"] == f"#{t.id}" and kl_tuned["paired"]
    assert any(f"#{t.id} and #{a.id} are scores of different models" in n for n in c.notes["differences"])
    with session_scope() as s:
        sa, sb = repo.get_score(s, a.id), repo.get_score(s, b.id)
    d = np.asarray(sb.figure("kl_by_sequence")) - np.asarray(sa.figure("kl_by_sequence"))
    assert kl["paired"] and kl["difference"] == pytest.approx(d.mean()) and len(d) == 3
    assert kl["err"] == pytest.approx(d.std(ddof=1) / np.sqrt(3))
    layers = {r["layer"]: r for r in c.schemes}
    q = layers["model.layers.0.self_attn.q_proj"]
    assert q[f"#{a.id}"] == "FP8_DYNAMIC" and q[f"#{b.id}"] == "INT8_W8A8_SQ" and q["differs"]
    assert len(layers) == 15


def test_outlier_drift_of_a_fine_tune_names_the_moved_and_grown_channels_and_what_clips(pair):
    base, tuned, cal_a, cal_b = pair
    c = compare.compare_runs([cal_a.id, cal_b.id])
    (rep,) = c.drift
    assert (rep.a, rep.b, rep.plan) == (f"#{cal_a.id}", f"#{cal_b.id}", compare.WHAT_IF)
    layers = {r["layer"]: r for r in rep.layers}
    for b in range(2):
        q = layers[f"model.layers.{b}.self_attn.q_proj"]
        assert q["verdict"] == "moved" and q["gone"] == [MOVED_FROM] and q["appeared"] == [MOVED_TO]
        down = layers[f"model.layers.{b}.mlp.down_proj"]
        assert down["outliers_a"][0] == GROWN and down["outliers_b"][0] == GROWN
        assert down["verdict"] == "grew" and down["grew"][0][0] == GROWN
        # grown by the fine-tune's up_proj row (4x), and by the moved q/k/v outlier upstream
        assert down["grew"][0][2] / down["grew"][0][1] >= 2.0
    transfer = {r["layer"]: r for r in rep.transfer}
    q = transfer["model.layers.0.self_attn.q_proj"]
    assert q["verdict"].startswith("clips") and MOVED_TO in q["under_smoothed"] and MOVED_TO in q["clipped_channels"]
    assert transfer["model.layers.0.mlp.down_proj"]["clipped_channels"][0] == GROWN
    assert "recalibrate on tuned" in rep.summary
    outliers = {r["layer"]: r for r in c.outliers}
    assert outliers["model.layers.0.self_attn.q_proj"][f"#{cal_a.id}"] == pytest.approx(layers[
        "model.layers.0.self_attn.q_proj"]["ratio_a"])


def test_calibrations_of_different_architectures_get_no_drift_and_say_why(qp_settings):
    from quantcore.evaluation.stats import HIST_BINS, LayerStats

    with session_scope() as s:
        llama = stored_model(s, "llama")
        qwen = repo.add_model(s, name="qwen", sha256="q" * 16, source_kind="folder", source_name="qwen",
                              path="models/qwen", summary={**llama.summary, "architecture": "Qwen2ForCausalLM"},
                              user="ann")
        cals = []
        for m in (llama, qwen):
            j = _job(s, m.id, kind="calibrate", params={"samples": 4})
            repo.save_activation_stats(s, job_id=j.id, model_id=m.id, stats=[LayerStats(
                name="a", in_features=4, out_features=8, n_tokens=8, channel_max=np.ones(4, np.float32),
                weight_channel_max=np.ones(4, np.float32), hist_counts=np.zeros(HIST_BINS, np.int64))])
            cals.append(j.id)
    c = compare.compare_runs(cals)
    assert c.drift == [] and len(c.outliers) == 1
    assert c.notes["drift"] == [f"#{cals[0]} → #{cals[1]}: #{cals[0]} calibrated a LlamaForCausalLM, #{cals[1]} a "
                                "Qwen2ForCausalLM: outlier drift compares models of one architecture (a base and "
                                "its fine-tune)"]


def test_drift_reads_a_plans_own_smoothing_and_refuses_a_plan_of_another_model(pair):
    from quantplan.services import plans as plans_svc

    base, tuned, cal_a, cal_b = pair
    body = {"default": "FP8_DYNAMIC", "rules": [{"match": r"mlp\.down_proj$", "scheme": "FP8"},
                                                {"match": r"self_attn\.\w_proj$", "scheme": "INT8_W8A8_SQ"}]}
    plan = plans_svc.save_plan(base, "sq", body)
    c = compare.compare_runs([cal_a.id, cal_b.id], plan_id=plan.id)
    assert len(c.drift) == 1, c.notes
    (rep,) = c.drift
    assert rep.plan == "plan sq v1"
    by = {r["layer"]: r for r in rep.transfer}
    assert set(by) == {f"model.layers.{b}.{p}" for b in range(2)
                       for p in ("mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                 "self_attn.o_proj")}
    assert by["model.layers.0.mlp.down_proj"]["alpha"] is None and by["model.layers.0.mlp.down_proj"]["static"]
    assert by["model.layers.0.self_attn.q_proj"]["alpha"] == 0.5 and not by["model.layers.0.self_attn.q_proj"][
        "static"]
    other = plans_svc.save_plan(tuned, "theirs", body)
    with pytest.raises(Refused, match=r"plan theirs v1 is a plan of model #\d+; the drift check reads a plan of "
                                      r"the base calibration's model \(base"):
        compare.compare_runs([cal_a.id, cal_b.id], plan_id=other.id)
