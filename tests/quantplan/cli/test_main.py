"""The `quantplan` command end to end in-process (--local job bodies, real database), on a tiny Llama checkpoint
saved to disk: register → calibrate → score → sensitivity → auto plan → export → import → bench; the clear errors
for bad input; the entry points (`python -m`, a closed pipe, Ctrl-C) and the help of every option."""

from __future__ import annotations

import json
import re

import pytest

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json


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
    from quantcore.kernels.roofline import step_bound
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import sweeps as sweeps_svc

    shapes = models_svc.layer_shapes(models_svc.get_model("tiny"))
    assert ideal["cost_unit"] == "ms" and any("roofline" in n and "M=1" in n for n in ideal["notes"])
    assert ideal["plan_label"].startswith("auto-h100-kl1000-ideal-m1 ")  # its own plan, not a new version of auto
    assert ideal["cost"] == pytest.approx(step_bound(ideal["plan"], shapes, "h100", 1).ms)
    assert ideal["baseline_cost"] == pytest.approx(step_bound({n: "BF16" for n in shapes}, shapes, "h100", 1).ms)
    with pytest.raises(SystemExit) as refused:  # refused when parsed, by the benchmark's rule for M
        run(capsys, "plan", "auto", "tiny", "--kl-budget", "1", "--target", "h100", "--cost", "ideal", "--m", "0",
            "--no-verify")
    assert refused.value.code == 2 and "argument --m: m must be between 1 and" in capsys.readouterr().err
    # for 2 GPUs: the cost is one GPU's step over its share of every layer, and the plan keeps the size
    two = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--cost", "ideal",
                   "--m", "1", "--tp", "2", "--no-verify", "--json")
    assert two["plan_label"].startswith("auto-h100-kl1000-ideal-m1-tp2 ")
    per_gpu = plans_svc.parallelism(models_svc.get_model("tiny"), {"tensor_parallel": 2}).shards(shapes)
    assert two["cost"] == pytest.approx(step_bound(two["plan"], per_gpu, "h100", 1).ms)
    assert two["cost"] < ideal["cost"]
    assert any("of one GPU's share of every layer over 2" in n for n in two["notes"])
    # its KL is predicted from one-GPU sweeps, which do not see each GPU's own dynamic scale of o_proj / down_proj
    row_int8 = [n for n, s in two["plan"].items() if n.endswith(("o_proj", "down_proj")) and s == "INT8_W8A8"]
    assert row_int8 and any("one-GPU sensitivity sweeps of INT8_W8A8" in n and "--tp 2" in n
                            for n in two["notes"])
    assert not any("one-GPU sensitivity sweeps" in n for n in ideal["notes"])
    assert plans_svc.get_plan(two["plan_id"]).body["tensor_parallel"] == 2
    # a sweep on 2 GPUs: what a plan for 2 GPUs reads from then on (a plan for one GPU still reads one GPU's)
    sens2 = run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--tp", "2", "--local",
                     "--samples", "2", "--seq-len", "32", "--json")
    assert sens2["tensor_parallel"] == 2
    swept2 = {r["layer"]: r["kl_mean"] for r in sens2["layers"]}
    swept1 = {r["layer"]: r["kl_mean"] for r in sens["layers"]}
    moved = {u for u in swept1 if swept1[u] != swept2[u]}
    assert moved and all(u.endswith(("o_proj", "down_proj")) for u in moved)
    model = models_svc.get_model("tiny")
    assert sweeps_svc.sensitivity_map(model, 2)[0]["INT8_W8A8"] == swept2
    assert sweeps_svc.sensitivity_map(model)[0]["INT8_W8A8"] == swept1
    again = run_json(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--cost", "ideal",
                     "--m", "1", "--tp", "2", "--no-verify", "--json")
    assert not any("one-GPU sensitivity sweeps" in n for n in again["notes"])
    assert again["predicted_kl"] == pytest.approx(sum(swept2[u] for u in swept2 if again["plan"].get(
        sweeps_svc.sensitivity_map(model, 2)[1][u][0]) == "INT8_W8A8"))
    # a weight-only scheme quantizes the same on any number of GPUs: swept on one, with a note saying so
    code, out, err = run(capsys, "sensitivity", "tiny", "--scheme", "W8A16", "--tp", "2", "--local", "--samples", "2",
                         "--seq-len", "32", "--json")
    w8 = json.loads(out)
    assert code == 0 and w8["tensor_parallel"] == 1
    assert "note: W8A16 has no dynamic activation scale over K" in err and "a plan for 2 reads exactly" in err
    jobs = len(jobs_svc.list_jobs(limit=100))
    code, _, err = run(capsys, "sensitivity", "tiny", "--scheme", "INT8_PER_TENSOR", "--tp", "3", "--local")
    assert code == 1 and "4 attention heads" in err
    code, _, err = run(capsys, "sensitivity", "tiny", "--kv-cache", "FP8", "--tp", "2", "--local")
    assert code == 1 and "per head" in err
    for cmd in ("sensitivity", "score"):  # an unknown scheme name: refused before any job, with the valid names
        code, _, err = run(capsys, cmd, "tiny", "--scheme", "fp8_dynamic", "--local")
        assert code == 1 and "unknown scheme 'fp8_dynamic' (did you mean 'FP8_DYNAMIC'?" in err
        assert "W4A16_G64" in err and "Traceback" not in err
    assert len(jobs_svc.list_jobs(limit=100)) == jobs
    from jobs.client import create_local_job
    from store.settings import get_settings
    from worker.bodies.sensitivity import sensitivity
    from worker.runner import run_job

    # a job queued for 3 GPUs by another client: the worker refuses it with vLLM's reason, before any reference
    job = create_local_job("sensitivity", {"scheme": "INT8_PER_TENSOR", "samples": 2, "seq_len": 32,
                                           "tensor_parallel": 3}, model_id=model.id, settings=get_settings())
    run_job(job.id, sensitivity, settings=get_settings())
    failed = jobs_svc.get_job(job.id)
    assert failed.status == "failed" and "4 attention heads" in failed.error
    # the same sweep queued with its GPUs by another client: the worker sweeps it on one GPU, as a plan reads it
    other = create_local_job("sensitivity", {"scheme": "W8A16", "tensor_parallel": 2, "samples": 2, "seq_len": 32},
                             model_id=model.id, settings=get_settings())
    assert run_job(other.id, sensitivity, settings=get_settings()) == "succeeded"
    other = jobs_svc.get_job(other.id)
    assert "tensor_parallel" not in other.result and sweeps_svc.sweep_parallel(other) == (1, False)
    assert other.message.endswith("swept on one GPU (its scales are the same on any number)")
    assert {r.unit: r.kl_mean for r in sweeps_svc.sensitivity_rows(other.id)} == {
        r["layer"]: r["kl_mean"] for r in w8["layers"]}

    # a plan file → stored → exported as a recipe → imported again: the same resolved plan
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\nname: mixed\ndefault: FP8_DYNAMIC\nrules:\n"
                         "  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'down_proj', scheme: INT8_W8A8}\n")
    imported = run_json(capsys, "plan", "import", str(plan_file), "--json")
    assert imported["new_version"] is True
    code, out, _ = run(capsys, "plan", "import", str(plan_file))  # the same file again: nothing new to store
    assert code == 0 and out.startswith(f"already stored as plan #{imported['id']} mixed v1 for tiny: no new version")
    recipe = tmp_path / "recipe.yaml"
    code, _, err = run(capsys, "plan", "export", "mixed", "--format", "llmcompressor", "-o", str(recipe))
    assert code == 0, err
    again = run_json(capsys, "plan", "import", str(recipe), "--model", "tiny", "--name", "from-recipe", "--json")
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import sweeps as sweeps_svc

    model = models_svc.get_model("tiny")
    a, _ = plans_svc.resolve(model, imported["body"])
    b, _ = plans_svc.resolve(model, again["body"])
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

    # the two paths the scores below read, and a budget no loaded machine runs out of: a case skipped for time
    # would leave a step without its timing (the budget is what the scheduler may spend, not what it spends)
    timed = ("bench", "tiny", "--local", "--m", "1,32", "--paths", "int8_row+q", "--budget", "600", "--json")
    records = run_json(capsys, *timed)
    keys = {"device", "m", "n", "k", "path", "ms", "tflops", "speedup", "native", "max_rel_err"}
    assert records and all(keys <= set(r) for r in records)
    # lm_head: vocab 25
    assert {(r["n"], r["k"]) for r in records} == {(64, 64), (32, 64), (128, 64), (64, 128), (25, 64)}
    assert all(r["ms"] is not None for r in records), [r["skipped"] for r in records]
    again = run_json(capsys, *timed)
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
    from quantplan.services import kernels as kernels_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    model = models_svc.get_model("tiny")
    listed = run_json(capsys, "scores", "tiny", "--json")
    assert listed["positions"] == 2 * 31 and listed["timings"] is None
    plans = {p["plan"]: p for p in listed["plans"]}
    assert [p["plan"] for p in listed["plans"]] == ["BF16", "INT8_PER_TENSOR"]  # lowest KL first
    bf16, int8 = plans["BF16"], plans["INT8_PER_TENSOR"]
    params = sum(n * k for n, k in models_svc.layer_shapes(model).values())
    assert bf16["kl_mean"] == 0.0 and bf16["weight_ratio"] == 1.0 and bf16["weight_mib"] == 2 * params / 2**20
    assert int8["weight_mib"] == plans_svc.plan_footprint(model, {"default": "INT8_PER_TENSOR"}).bits / 8 / 2**20
    assert 0.5 < int8["weight_ratio"] < 0.6  # 8 of 16 bits, plus one scale per tensor
    # each is best at one thing (BF16: KL, INT8: memory), so both are on the front
    assert bf16["front_weight_mib"] and int8["front_weight_mib"]
    assert bf16["notes"] == [] and int8["notes"] == []  # scored by this quantplan: nothing to say
    assert bf16["prefill_ms"] is None and "front_decode_ms" not in bf16

    device = kernels_svc.kernel_devices()[0][1]
    timed = run_json(capsys, "scores", "tiny", "--timings", device, "--json")
    assert (timed["m_prefill"], timed["m_decode"]) == (32, 1)
    ms = {(r["m"], r["n"], r["k"], r["path"]): r["ms"] for r in bench_records}
    shapes = models_svc.layer_shapes(model).values()
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
        plan = {name: row["plan"] for name in models_svc.layer_shapes(model)}
        assert row["ideal_decode_ms"] == pytest.approx(step_bound(plan, models_svc.layer_shapes(model), "h100", 4).ms)
        bound = step_bound(plan, models_svc.layer_shapes(model), "h100", 512)
        assert row["ideal_prefill_ms"] == pytest.approx(bound.ms)
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

    from quantplan.cli.main import build_parser

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


def test_ctrl_c_says_what_became_of_the_job_in_one_line(tiny_model, capsys, monkeypatch):
    """Ctrl-C while waiting leaves the job queued and says so; Ctrl-C in a --local run ends the job as cancelled;
    either way one line and exit 130, never a traceback. A job for a device this machine lacks is not offered
    --local."""
    from jobs import client
    from quantplan.services import jobs as jobs_svc
    from worker.bodies import calibrate as calibrate_body

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "wait_for", ctrl_c)
    code, _, err = run(capsys, "bench", "tiny", "--m", "1")  # queued on 'cpu'; no worker runs in the tests
    job = max(jobs_svc.list_jobs(kind="bench"), key=lambda j: j.id)
    assert code == 130 and "Traceback" not in err
    assert err.rstrip().endswith(f"quantplan: stopped waiting; job #{job.id} is still queued "
                                 f"(`quantplan jobs show {job.id}`, `quantplan jobs cancel {job.id}`)")
    assert "No worker consuming queue 'cpu'" in err and "Or run it here with --local." in err
    assert "worker --queues cpu`. Or run" in err
    code, _, err = run(capsys, "bench", "tiny", "--m", "1", "--device", "cuda")
    if not __import__("torch").cuda.is_available():
        assert code == 130 and "No worker consuming queue 'gpu" in err and "--local" not in err
    monkeypatch.undo()
    monkeypatch.setattr(calibrate_body, "calibrate", ctrl_c)
    code, _, err = run(capsys, "calibrate", "tiny", "--samples", "2", "--seq-len", "16", "--local")
    job = max(jobs_svc.list_jobs(kind="calibrate"), key=lambda j: j.id)
    assert code == 130 and "Traceback" not in err and job.status == "cancelled"
    assert err.rstrip().endswith(f"quantplan: job #{job.id} cancelled: interrupted (Ctrl-C) before it finished")
