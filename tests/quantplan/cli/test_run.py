"""`quantplan calibrate | score | sensitivity | bench`: scores on several GPUs, the GPTQ / AWQ / KV maxima kept
between jobs, sensitivity sweeps of linear layers and of the KV cache, benchmarks and what each refuses before
any job."""

from __future__ import annotations

import json
import re

import pytest

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json


def test_a_plan_is_scored_as_served_on_several_gpus(tiny_model, capsys, tmp_path):
    """``score --tp 2``: each GPU quantizes its half of o_proj's and down_proj's input on its own dynamic scale, so
    the KL moves; the stored plan says 2 GPUs. A GPU count the heads cannot be split over (given with --tp or by a
    plan file) is refused before any job, and so is --expert-parallel without --tp."""
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    one = run_json(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", *args)
    split = run_json(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", "--tp", "2", *args)
    assert split["plan"] == "INT8_PER_TENSOR (TP 2)" and split["kl_mean"] != one["kl_mean"]
    static = [run_json(capsys, "score", "tiny", "--scheme", "W8A16", *tp, *args) for tp in ((), ("--tp", "2"))]
    assert static[0]["kl_mean"] == static[1]["kl_mean"]  # weight-only: the same numbers on any number of GPUs
    stored = next(s for s in scoring_svc.list_scores(models_svc.get_model("tiny").id) if s.job_id == split["job"])
    assert stored.plan_body["tensor_parallel"] == 2
    jobs = len(jobs_svc.list_jobs(limit=100))
    code, _, err = run(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", "--tp", "3", "--local")
    assert code == 1 and "4 attention heads" in err
    code, _, err = run(capsys, "score", "tiny", "--scheme", "INT8_PER_TENSOR", "--expert-parallel", "--local")
    assert code == 1 and "--expert-parallel needs --tp" in err
    plan = tmp_path / "tp3.yaml"  # a plan file for 3 GPUs: refused as --tp 3 is
    plan.write_text("model: tiny\ndefault: INT8_PER_TENSOR\ntensor_parallel: 3\n")
    code, _, err = run(capsys, "score", "tiny", "--plan", str(plan), "--local")
    assert code == 1 and "4 attention heads" in err
    assert len(jobs_svc.list_jobs(limit=100)) == jobs


def test_gptq_rounded_weights_are_kept_and_read_again_only_where_the_rounding_reads_the_same(tiny_model, capsys,
                                                                                             tmp_path):
    """A job keeps each layer's GPTQ-rounded weight on disk; another job whose rounding of that layer reads the same
    (scheme, fusion group, AWQ layers, calibration tokens and statistics) takes it from there, with the same KL as
    rounding it again, and one that reads something else rounds it anew."""
    import shutil

    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc
    from store import repo
    from store.db import session_scope
    from store.settings import get_settings

    args = ("--local", "--samples", "2", "--seq-len", "32", "--cal-samples", "4", "--cal-seq-len", "32", "--json")
    kept = get_settings().model_reference_dir(models_svc.get_model("tiny").sha256) / "gptq"
    numbers = ("kl_mean", "kl_p99", "top1_agree", "ppl")

    def score(scheme: str) -> dict:
        return run_json(capsys, "score", "tiny", "--scheme", scheme, *args)

    def sweep(scheme: str, *more: str) -> tuple[dict, dict]:
        res = run_json(capsys, "sensitivity", "tiny", "--scheme", scheme, *more, *args)
        return {r["layer"]: r["kl_mean"] for r in res["layers"]}, jobs_svc.get_job(res["job"]).result["gptq"]

    cold = score("W4A16_GPTQ")
    assert cold["gptq"] == {"layers": 15, "from_cache": 0} and len(list(kept.glob("*.safetensors"))) == 15
    warm = score("W4A16_GPTQ")
    assert warm["gptq"] == {"layers": 15, "from_cache": 15}
    assert jobs_svc.get_job(warm["job"]).message.endswith("(from the cache: GPTQ 15 of 15 layers)")
    assert "from the cache" not in jobs_svc.get_job(cold["job"]).message
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
    assert jobs_svc.list_jobs(limit=1)[0].message == "W4A16_GPTQ: 9 units swept (from the cache: GPTQ 15 of 15 layers)"
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
    with session_scope(get_settings()) as s:
        queued = repo.create_job(s, kind="score", params={}, queue="cpu", user=None, model_id=models_svc.get_model(
            "tiny").id)
    code, _, err = run(capsys, "models", "cache", "tiny", "--clear")
    assert code == 1 and f"#{queued.id} score" in err and kept.is_dir()
    jobs_svc.cancel_job(queued.id)
    cleared = run_json(capsys, "models", "cache", "tiny", "--clear", "--json")
    assert cleared["cleared_bytes"] == sum(on_disk.values()) and not kept.parent.exists()
    assert all(f == {"files": 0, "bytes": 0} for f in cleared["files"].values())  # what is left, as the total says
    assert all(f == {"files": 0, "bytes": 0} for f in run_json(capsys, "models", "cache", "tiny", "--json")[
        "files"].values())
    assert score("INT8_W8A8_SQ_GPTQ")["gptq"]["from_cache"] == 0  # rounded again, results untouched
    assert len(scoring_svc.list_scores(models_svc.get_model("tiny").id)) > 10
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
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from store.settings import get_settings

    args = ("--local", "--samples", "2", "--seq-len", "32", "--cal-samples", "4", "--cal-seq-len", "32", "--json")
    refs = get_settings().model_reference_dir(models_svc.get_model("tiny").sha256)

    def score(*more: str) -> dict:
        return run_json(capsys, "score", "tiny", *args, *more)

    first = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")
    assert first["kv_amax_cached"] is False and len(list(refs.glob("kv-*.json"))) == 1
    other_text = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8", "--samples", "3")
    assert other_text["kv_amax_cached"] is True and other_text["tokens"] != first["tokens"]
    again = score("--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8")
    assert again["kv_amax_cached"] is True and again["kl_mean"] == first["kl_mean"]
    assert jobs_svc.get_job(again["job"]).message.endswith("(from the cache: KV maxima)")
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
    for row in rows:  # each time with its spread and repeats, and the baseline timed between a path's calls
        m, n, k, path, ms, p20, p80, reps, base, _tflops, _pct, speedup, native, err_ = row.split()[:14]
        assert m == "1" and path in ("baseline", "int8_row") and float(ms) > 0 and float(speedup) > 0
        assert float(p20) <= float(ms) <= float(p80) and int(reps) >= 3 and (base == "-") == (path == "baseline")
        assert float(err_) < 1e-3 and native in ("yes", "no")
    code, _, err = run(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths", "int8_row")
    assert code == 0 and re.search(r"running .*all 5 shapes stored", err)


def test_a_stored_timing_whose_native_flag_is_outdated_is_measured_again(tiny_model, capsys):
    """Records stored under other rules for this device (INT8 on a VNNI CPU was once 'not native') are
    re-measured, so the Kernels page shows the flag the device's probe gives now; the others are reused."""
    from sqlalchemy import update

    from store import models as m
    from store.db import session_scope

    first = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "600", "--json")
    with session_scope() as s:
        n, k = first[0]["n"], first[0]["k"]  # one shape's INT8 record, as an older quantplan stored it
        s.execute(update(m.KernelResult).where(m.KernelResult.path == "int8_row", m.KernelResult.n == n,
                                               m.KernelResult.k == k).values(native=~m.KernelResult.native))
    again = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "600", "--json")
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
    run_json(capsys, "bench", "tiny", "--local", "--m", "1,32", "--budget", "600", "--json")
    per_shape = len(first) // len({(r["n"], r["k"]) for r in first})
    measured = len(skipped) * per_shape
    assert newest_bench_message().startswith(f"{measured} cases measured, {len(first) - measured} reused")


def test_a_stored_timing_timed_another_way_is_measured_again(tiny_model, capsys):
    """Records from before quantplan flushed a CPU's caches between timed calls (timing NULL) are measured again
    the next time the device is asked, and stay in the history; the new ones say how they were timed."""
    from sqlalchemy import update

    from quantcore.kernels.records import TIMING
    from store import models as m
    from store.db import session_scope

    first = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "600", "--json")
    assert {r["timing"] for r in first} == {TIMING}
    with session_scope() as s:
        n, k = first[0]["n"], first[0]["k"]  # one shape, as an older quantplan stored it
        s.execute(update(m.KernelResult).where(m.KernelResult.n == n, m.KernelResult.k == k).values(timing=None))
    again = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "600", "--json")
    assert len(again) == len(first) and {r["timing"] for r in again} == {TIMING}
    per_shape = sum((r["n"], r["k"]) == (n, k) for r in first)
    bench_jobs = [j for j in run_json(capsys, "jobs", "--json") if j["kind"] == "bench"]
    assert max(bench_jobs, key=lambda j: j["id"])["message"].startswith(
        f"{per_shape} cases measured, {len(first) - per_shape} reused")
    with session_scope() as s:  # the older rows stay in the history
        assert s.query(m.KernelResult).filter(m.KernelResult.timing.is_(None)).count() == per_shape


def test_a_kv_cache_sweep_ranks_the_attention_layers(tiny_model, capsys):
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import sweeps as sweeps_svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    swept = run_json(capsys, "sensitivity", "tiny", "--kv-cache", "FP8_E5M2", *args)
    assert swept["scheme"] == "KV FP8_E5M2"
    assert sorted(r["layer"] for r in swept["layers"]) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(r["kl_mean"] > 0 and r["sqnr_db"] is None for r in swept["layers"])
    model = models_svc.get_model("tiny")
    job, by_index = sweeps_svc.kv_sensitivity(model, "FP8_E5M2")
    assert job == swept["job"] and by_index == {str(int(r["layer"].split(".")[2])): r["kl_mean"]
                                                for r in swept["layers"]}
    assert sweeps_svc.kv_sensitivity(model, "FP8") is None
    # the linear-layer map an automatic plan chooses from never sees it (its units are not linears)
    run_json(capsys, "sensitivity", "tiny", "--scheme", "FP8_DYNAMIC", *args)
    assert set(sweeps_svc.sensitivity_map(model)[0]) == {"FP8_DYNAMIC"}
    jobs = {j.id: jobs_svc.job_what(j) for j in jobs_svc.list_jobs(model_id=model.id)}
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
                         (("--kv-cache", "AUTO", "--kl-budget", "1"), "AUTO quantizes nothing")):
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
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc

    args = ("--local", "--samples", "2", "--seq-len", "32")
    swept = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8_SQ", *args, "--json")
    layers = [n for r in swept["layers"] for n in r["layers"]]
    names = [lin["name"] for lin in models_svc.get_model("tiny").linears]
    assert sorted(swept["not_swept"]) == sorted(n for n in names if n.endswith(("o_proj", "lm_head")))
    assert len(swept["not_swept"]) == 3 and sorted(layers) == sorted(set(names) - set(swept["not_swept"]))
    assert ("units swept; not swept: 3 layer(s) no llm-compressor recipe can smooth ('model"
            in jobs_svc.get_job(swept["job"]).message)
    plain = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", *args, "--json")
    assert plain["not_swept"] == [] and sorted(n for r in plain["layers"] for n in r["layers"]) == sorted(names)
    assert jobs_svc.get_job(plain["job"]).result["tokens"] == [2, 32]  # what it ran on, for the Results page's notes
    code, out, _ = run(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8_SQ", *args)
    assert code == 0 and "not swept: 3 layer(s) no llm-compressor recipe can smooth" in out


def test_a_benchmark_split_over_gpus_times_each_gpus_share(tiny_model, capsys, tmp_path):
    """bench --tp 2 times the tiny Llama's layers as each of 2 GPUs runs them (q_proj 32 of its 64 outputs, k_proj
    one of its 2 heads of 16, down_proj 64 of its 128 inputs); a plan for 2 GPUs then has a measured step."""
    from quantcore.kernels.paths import distinct_shapes
    from quantplan.services import kernels as kernels_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    model = models_svc.get_model("tiny")
    records = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "600", "--tp", "2", "--json")
    measured = {(r["n"], r["k"]) for r in records}
    par = plans_svc.parallelism(model, {"default": "BF16", "tensor_parallel": 2})
    shards = par.shards(models_svc.layer_shapes(model))
    assert measured == set(distinct_shapes((name, k, n) for name, (n, k) in shards.items()))
    # q_proj 32 x 64, k/v 16 x 64, o_proj 64 x 32; gate/up (128 / 2 rows) and down_proj (128 / 2 inputs) 64 x 64
    assert {(32, 64), (16, 64), (64, 32), (64, 64)} <= measured and (128, 64) not in measured
    [(_, device_name, _)] = kernels_svc.kernel_devices()
    two = kernels_svc.step_estimate(model, {"default": "FP8_DYNAMIC", "tensor_parallel": 2}, device_name,
                            m_prefill=1, m_decode=1)
    assert two["missing_decode"] == [] and two["decode_ms"] > 0
    one = kernels_svc.step_estimate(model, {"default": "FP8_DYNAMIC"}, device_name, m_prefill=1, m_decode=1)
    assert one["missing_decode"]  # the whole layers were not timed here
    labels = kernels_svc.shape_labels(model)
    assert labels[(16, 64)] == "k_proj/v_proj 16×64 (TP 2)" and labels[(64, 32)] == "o_proj 64×32 (TP 2)"
    assert labels[(64, 64)] == "q_proj/o_proj 64×64"  # every layer type with the shape names its row
    # the count the Kernels page's queued message bounds the run's duration by: the shapes the job timed
    assert kernels_svc.bench_shape_count(model, 2) == len(measured) and kernels_svc.bench_shape_count(model) == 5
    code, _, err = run(capsys, "bench", "--tp", "2", "--local")
    assert code == 1 and "--tp needs a MODEL" in err


def test_a_local_job_on_a_device_this_machine_lacks_is_refused_before_any_job(tiny_model, capsys):
    import torch

    from quantplan.services import jobs as jobs_svc

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: a local CUDA job runs")
    jobs = len(jobs_svc.list_jobs(limit=100))
    for argv in (("bench", "tiny", "--device", "cuda", "--local", "--m", "1"),
                 ("calibrate", "tiny", "--device", "cuda", "--local")):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "no CUDA device" in err and "without --local" in err and "Traceback" not in err
    assert len(jobs_svc.list_jobs(limit=100)) == jobs  # nothing written


def test_a_score_of_a_stored_plan_names_the_version_it_measured(tiny_model, capsys, tmp_path):
    from quantplan.cli.common import run_job as run_job_here
    from quantplan.services import models as models_svc

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\nname: mine\ndefault: INT8_W8A8\nrules:\n  - {match: 'lm_head', scheme: BF16}\n")
    run_json(capsys, "plan", "import", str(plan_file), "--json")
    plan_file.write_text("model: tiny\nname: mine\ndefault: FP8_DYNAMIC\nrules:\n"
                         "  - {match: 'lm_head', scheme: BF16}\n")
    second = run_json(capsys, "plan", "import", str(plan_file), "--json")
    scored = run_job_here("score", {"samples": 2, "seq_len": 32}, model_id=models_svc.get_model("tiny").id,
                          plan_id=second["id"], local=True, quiet=True)  # as the Results page queues a plan
    assert scored.result["plan"] == "mine v2"  # which version of the plan was measured


def test_bench_m_values_that_are_not_positive_integers_are_refused_before_any_job(tiny_model, capsys):
    from quantplan.services import jobs as jobs_svc

    jobs = len(jobs_svc.list_jobs(limit=100))
    for bad, named in (("abc", "'abc' is not one"), ("1,0", "'0' is not one"), ("16,-2", "'-2' is not one"),
                       ("1.5", "'1.5' is not one"), (",", "no M value given")):
        code, err = _parse_refusal(capsys, "bench", "tiny", "--local", "--m", bad)
        assert code == 2 and "argument --m: " in err and named in err and "Traceback" not in err, err
    assert len(jobs_svc.list_jobs(limit=100)) == jobs  # nothing queued, nothing run


def test_bench_paths_times_those_and_the_baseline_and_refuses_an_unknown_one_before_any_job(tiny_model, capsys):
    from quantplan.services import jobs as jobs_svc

    records = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths",
                       "int8_row+q, w8_row", "--json")
    assert {r["path"] for r in records} == {"baseline", "int8_row+q", "w8_row"}
    assert all(r["speedup"] is not None for r in records if r["ms"] is not None)  # against the baseline beside them
    job = max(jobs_svc.list_jobs(kind="bench"), key=lambda j: j.id)
    assert job.params["paths"] == ["int8_row+q", "w8_row"] and "int8_row+q, w8_row" in jobs_svc.jobs_what([job])[job.id]
    # asked again: all of it reused from the store, the baselines too (they were left out of a subset's reuse)
    again = run_json(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths",
                     "int8_row+q, w8_row", "--json")
    key = lambda r: (r["m"], r["n"], r["k"], r["path"])  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, records))
    newest = max(jobs_svc.list_jobs(kind="bench"), key=lambda j: j.id)
    assert newest.result["measured"] == 0 and newest.result["reused"] == len(records)
    # the job stores what it found the device to be, and the text output leads with it
    support = {p["path"]: p for p in newest.result["paths"]}
    assert support["baseline"]["runs"] and support["baseline"]["native"] and not support["fp4"]["runs"]
    code, out, _ = run(capsys, "bench", "tiny", "--local", "--m", "1", "--budget", "20", "--paths", "w8_row")
    device = newest.result["device"]
    assert code == 0 and f"\n{device['name']} · " in out and f"torch {device['torch_version']}" in out
    assert re.search(r"^  fp4 +does not run +FP4 matmul needs Blackwell", out, re.M), out
    jobs = len(jobs_svc.list_jobs(limit=100))
    code, _, err = run(capsys, "bench", "tiny", "--local", "--m", "1", "--paths", "int8_row,fp16")
    assert code == 1 and err.startswith("quantplan: --paths: unknown kernel path 'fp16'") and "Traceback" not in err
    assert len(jobs_svc.list_jobs(limit=100)) == jobs


def _parse_refusal(capsys, *argv: str) -> tuple[int, str]:
    """Run ``quantplan ARGV`` that argparse refuses: (exit status, stderr)."""
    from quantplan.cli import main

    with pytest.raises(SystemExit) as caught:
        main(list(argv))
    return caught.value.code, capsys.readouterr().err


def _job_rows() -> int:
    from sqlalchemy import func, select

    from store import models as m
    from store.db import session_scope

    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(m.Job))


def test_text_sizes_a_job_cannot_use_are_refused_before_any_job(tiny_model, capsys):
    """--samples 0 used to score 16 sequences (0 read as "not given"), and --seq-len 1 or --samples -1 made a job
    that then failed: each is now refused by name when the command line is parsed, and nothing is written."""
    jobs = _job_rows()
    for argv, said in ((("score", "tiny", "--scheme", "FP8", "--samples", "0"),
                        "argument --samples: samples must be between 1 and 65,536 sequences, got 0"),
                       (("score", "tiny", "--scheme", "FP8", "--seq-len", "1"), "seq_len must be between 2 and"),
                       (("sensitivity", "tiny", "--scheme", "FP8", "--seq-len", "1"), "first token is predicted"),
                       (("calibrate", "tiny", "--samples", "-1"), "samples must be between 1 and 65,536 sequences, "
                                                                  "got -1"),
                       (("calibrate", "tiny", "--seq-len", "0"), "seq_len must be between 1 and")):
        code, err = _parse_refusal(capsys, *argv, "--local")
        assert code == 2 and said in err and "Traceback" not in err, (argv, err)
    assert _job_rows() == jobs


@pytest.mark.parametrize(("argv", "said"), [
    # `score --tp 0` meant one GPU (0 read as "not given") while a plan file's tensor_parallel: 0 is refused
    (("score", "tiny", "--scheme", "FP8", "--tp", "0"),
     "argument --tensor-parallel/--tp: tensor_parallel must be between 1 and 1024 GPUs, got 0"),
    (("sensitivity", "tiny", "--scheme", "FP8", "--tp", "2000"), "tensor_parallel must be between 1 and 1024 GPUs"),
    (("bench", "--m", "1", "--paths", "int8_row", "--tp", "0"), "tensor_parallel must be between 1 and 1024 GPUs"),
    # `bench --budget -1` made a job row that failed; `--budget 0` was timed for the default 60 s a shape
    (("bench", "--m", "1", "--paths", "int8_row", "--budget", "-1"),
     "argument --budget: budget_s must be more than 0 and at most 604,800 seconds, got -1"),
    (("bench", "--m", "1", "--paths", "int8_row", "--budget", "0"), "budget_s must be more than 0"),
    (("bench", "--m", "1", "--paths", "int8_row", "--budget", "nan"),
     "budget_s must be a number of seconds such as 60, got 'nan'"),
    # a sequence of a billion tokens made a job row that failed; a hundred million sequences likewise
    (("calibrate", "tiny", "--seq-len", "1000000000"), "seq_len must be between 1 and 1,048,576 tokens, "
                                                       "got 1,000,000,000"),
    (("calibrate", "tiny", "--samples", "100000000"), "samples must be between 1 and 65,536 sequences, "
                                                      "got 100,000,000"),
    (("score", "tiny", "--scheme", "FP8", "--cal-samples", "100000000"), "argument --cal-samples: cal_samples"),
    (("score", "tiny", "--scheme", "FP8", "--cal-seq-len", "0"), "argument --cal-seq-len: cal_seq_len must be"),
    (("score", "tiny", "--scheme", "FP8", "--samples", "2.5"), "samples must be a whole number of sequences"),
    # numbers that are no job's parameter keep a rule of their own in jobs.specs too (exit 1 or unbounded before)
    (("bench", "--m", "1,99999999999"), "argument --m: m must be between 1 and 16,777,216 rows"),
    (("jobs", "list", "--limit", "0"), "argument --limit: limit must be between 1 and 100,000 jobs, got 0"),
    (("plan", "auto", "tiny", "--kl-budget", "nan", "--target", "h100"),
     "argument --kl-budget: kl_budget must be a number of nats per token such as 0.02, got 'nan'"),
    (("plan", "kv-skip", "tiny", "--kv-cache", "FP8_E5M2", "--kl-budget", "-1"),
     "argument --kl-budget: kl_budget must be between 0 and 1000 nats per token, got -1"),
    (("plan", "kv-skip", "tiny", "--kv-cache", "FP8_E5M2", "--kl-budget", "1", "--context", "0"),
     "argument --context: context must be between 1 and 1,048,576 tokens, got 0"),
    (("plan", "show", "p", "--target", "h100", "--batch", "0"), "argument --batch: batch must be between 1 and"),
    (("plan", "show", "p", "--prompt", "-5"), "argument --prompt: prompt must be between 1 and"),
    (("scores", "tiny", "--m-prefill", "0"), "argument --m-prefill: m must be between 1 and"),
    (("scores", "tiny", "--serve", "0", "4096"), "argument --serve: serve must be between 1 and"),
])
def test_numbers_no_job_can_use_are_refused_when_parsed_and_no_job_row_is_written(qp_settings, capsys, argv, said):
    """Every numeric option of a job command is checked when the command line is parsed, by the job parameter's
    one rule (jobs.specs): exit status 2, the rule's sentence, and the jobs table stays empty (no model is even
    looked up: none is registered here)."""
    code, err = _parse_refusal(capsys, *argv, "--local")
    assert code == 2 and said in err and "Traceback" not in err, err
    assert _job_rows() == 0


def test_score_tp_0_is_refused_in_the_words_a_plan_files_tensor_parallel_0_is(tiny_model, capsys, tmp_path):
    plan = tmp_path / "tp0.yaml"
    plan.write_text("model: tiny\ndefault: FP8\ntensor_parallel: 0\n")
    jobs = _job_rows()
    code, _, from_file = run(capsys, "score", "tiny", "--plan", str(plan), "--local")
    code_tp, from_option = _parse_refusal(capsys, "score", "tiny", "--scheme", "FP8", "--tp", "0", "--local")
    words = "tensor_parallel must be between 1 and 1024 GPUs, got 0"
    assert (code, code_tp) == (1, 2) and words in from_file and words in from_option, (from_file, from_option)
    assert _job_rows() == jobs


def test_a_sequence_longer_than_the_models_context_is_refused_before_any_job(tiny_model, capsys):
    """The tiny Llama reads 128 positions (its config's max_position_embeddings, kept in its stored summary): a
    longer --seq-len or --cal-seq-len is refused before any job row, naming the context; the context itself is
    accepted."""
    from quantplan.services import models as models_svc

    assert models_svc.get_model("tiny").context == 128
    jobs = _job_rows()
    for argv, option in ((("calibrate", "tiny", "--seq-len", "129"), "--seq-len 129"),
                         (("score", "tiny", "--scheme", "FP8", "--seq-len", "1000"), "--seq-len 1000"),
                         (("sensitivity", "tiny", "--scheme", "FP8", "--seq-len", "32", "--cal-seq-len", "4096"),
                          "--cal-seq-len 4096")):
        code, _, err = run(capsys, *argv, "--local")
        assert code == 1 and f"quantplan: {option} is longer than tiny's context: its config's " \
            "max_position_embeddings is 128 tokens" in err, err
    assert _job_rows() == jobs
    calibrated = run_json(capsys, "calibrate", "tiny", "--samples", "2", "--seq-len", "128", "--local", "--json")
    assert calibrated["layers"]


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
