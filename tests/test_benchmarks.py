"""The benchmark scripts run and write what they say (timings are not checked: that is their job)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    return _load(name, folder="scripts")


def _load(name: str, folder: str = "benchmarks"):
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_model_shapes_follow_the_configs() -> None:
    kg = _load("kernel_gemm")
    smol = kg.MODELS["smollm2-135m"].layer_shapes()
    assert smol["k_proj"] == (192, 576) and smol["down_proj"] == (576, 1536)
    llama = kg.MODELS["llama-3-8b"].layer_shapes()
    assert llama["gate_proj"] == (14336, 4096) and llama["v_proj"] == (1024, 4096)
    assert len(set(llama.values())) == 4  # q/o, k/v, gate/up, down


def test_kernel_gemm_writes_json_and_markdown(tmp_path: Path, capsys) -> None:
    kg = _load("kernel_gemm")
    out_json, out_md = tmp_path / "k.json", tmp_path / "k.md"
    rc = kg.main(["--m", "1", "--budget", "2", "--repeats", "3", "--paths", "int8_row",
                  "--json", str(out_json), "--markdown", str(out_md)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["model"] == "smollm2-135m" and data["device"]["kind"] == "cpu"
    shapes = {(r["n"], r["k"]) for r in data["records"]}
    assert shapes == {(576, 576), (192, 576), (1536, 576), (576, 1536)}
    assert {r["path"] for r in data["records"]} == {"baseline", "int8_row"}
    md = out_md.read_text().splitlines()
    assert md[0].startswith("SmolLM2-135M shapes, M = 1;")
    assert sum(line.startswith("| ") for line in md) == 1 + 4  # header + one row per shape
    assert "GEMM time per step" in capsys.readouterr().out


def test_kernel_gemm_sets_each_step_against_the_roofline_of_a_gpu_of_the_table(monkeypatch, capsys) -> None:
    """On a GPU of the table each whole-model step also reads as a multiple of its roofline bound. The probe
    is told it is an H100 (only the printing is under test: the timings are this CPU's)."""
    import dataclasses
    import re

    from quantcore.kernels.device import probe_device
    from quantcore.kernels.roofline import step_bound

    kg = _load("kernel_gemm")
    monkeypatch.setattr(kg, "probe_device", lambda device: dataclasses.replace(probe_device("cpu"), target_key="h100"))
    # no case flagged unstable (a busy machine's spread would leave a layer out of the step, which is not under test)
    monkeypatch.setattr("quantcore.kernels.records.UNSTABLE_SPREAD", float("inf"))
    assert kg.main(["--m", "1", "--budget", "2", "--repeats", "3", "--paths", "int8_row"]) == 0
    out = capsys.readouterr().out
    model = kg.MODELS["smollm2-135m"]
    layers = {f"layers.{i}.{p}": s for i in range(model.n_layers) for p, s in model.layer_shapes().items()}
    line = next(x for x in out.splitlines() if x.strip().startswith("baseline") and "decode" in x)
    measured = float(re.search(r"decode\s+([\d.]+) ms", line).group(1))
    ideal = step_bound({n: "BF16" for n in layers}, layers, "h100", 1).ms
    ratio = float(re.search(r"\[([\d.]+)x the roofline ([\d.]+) ms\]", line).group(1))
    assert f"the roofline {ideal:.3f} ms]" in line
    # the ratio is printed to 0.1 from the unrounded time; the time is printed to 0.001 ms
    assert ratio == pytest.approx(measured / ideal, abs=0.05 + 0.0005 / ideal + 1e-9)


@pytest.mark.slow
def test_gpu_check_script_dry_run_on_cpu(tmp_path: Path) -> None:
    # scripts/gpu_check.sh is what a session with a lent GPU runs, once, in a few minutes of device
    # time: keep it working here, where DEVICE=cpu runs every step but the nvidia-smi one (its Python steps forked from
    # one process that imported torch once, scripts/forkserver.py: 207 -> 83 s of CPU on a busy 2-core machine).
    out = tmp_path / "out"
    # That machine's image has no gensim, whose corpus is the default text: an empty gensim package ahead of ours
    # on the path, so a step that falls back to the default text fails here as it would there.
    (tmp_path / "no-corpus" / "gensim").mkdir(parents=True)
    (tmp_path / "no-corpus" / "gensim" / "__init__.py").write_text("")
    env = {**os.environ, "DEVICE": "cpu", "BUDGET": "0.5", "MS": "1", "PYTHON": sys.executable,
           "OUT": str(out), "GPU_CHECK_HOME": str(tmp_path / "home"), "QUANTPLAN_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "no-corpus"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rcs = dict(line.split(": rc=") for line in (out / "summary.txt").read_text().splitlines())
    rcs = {k: v.split()[0] for k, v in rcs.items()}
    for step in ("gpu-tests", "kernels-smollm2", "kernels-llama8b", "migrate", "bench-measure",
                 "bench-reuse", "tiny-model", "models-add", "calibrate", "calibrate-stream", "score", "score-stream",
                 "sensitivity", "sensitivity-stream", "sensitivity-gptq-stream", "sensitivity-awq-stream",
                 "sensitivity-rotated-stream", "fisher", "fisher-stream", "fisher-kv-stream",
                 "score-kv", "kv-sweep", "kv-sweep-stream",
                 "score-gptq", "score-gptq-kept", "score-rollouts", "jobs", "placement", "rotation", "fisher-bench"):
        assert rcs[step] == "0", (step, (out / "gpu_check.log").read_text()[-3000:])
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.log", "kernel_llama8b.json", "kernel_llama8b.md", "kernel_smollm2.json",
        "kernel_smollm2.md", "quantplan_bench.json", "summary.txt"]
    bench = json.loads((out / "quantplan_bench.json").read_text())
    assert {(r["n"], r["k"]) for r in bench} == {(576, 576), (192, 576), (1536, 576), (576, 1536)}
    assert "Llama-3-8B shapes" in (out / "kernel_llama8b.md").read_text()
    log = (out / "gpu_check.log").read_text()
    assert "FP8_DYNAMIC on tiny: KL mean" in log and "INT8_W8A8 one unit at a time on tiny" in log
    assert "FP8_DYNAMIC + KV FP8_ATTN on tiny: KL mean" in log and "KV FP8_ATTN one unit at a time on tiny" in log
    assert "W4A16_GPTQ on tiny: KL mean" in log and "GPTQ rounded its weights with the input Hessians of" in log
    assert "15 of its 15 layer(s) as an earlier job rounded them" in log

    # and scripts/gpu_figures.py turns the run into the README's block, the same way twice
    figures = _load_script("gpu_figures")
    readme = tmp_path / "README.md"
    readme.write_text("before\n" + figures.START + "\n(no GPU run yet)\n" + figures.END + "\nafter\n")
    assert figures.main([str(out), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "(no GPU run yet)" not in text
    assert "`pytest -m gpu`: " in text and "skipped" in text.split("`pytest -m gpu`: ")[1].splitlines()[0]
    assert "kernels-llama8b ok" in text and "**Llama-3-8B**" in text and "| N × K | M |" in text
    assert "**Llama-3-8B**: speed-up over fp32 ·" in text  # a CPU's baseline GEMM (a GPU's: bf16)
    assert figures.main([str(out), "--readme", str(readme)]) == 0 and readme.read_text() == text
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no block here\n")
    with pytest.raises(SystemExit, match="no <!-- gpu-figures:start -->"):
        figures.update_readme(plain, out)


def test_the_gpu_results_page_has_the_block_gpu_figures_fills() -> None:
    figures = _load_script("gpu_figures")
    text = (ROOT / "docs" / "results" / "gpu-h200.md").read_text()
    assert text.count(figures.START) == 1 and text.count(figures.END) == 1
    assert text.index(figures.START) < text.index(figures.END)


def test_rounding_cost_times_gptq_and_awq_against_a_forward(capsys) -> None:
    rc = _load("rounding_cost").main(["--seqs", "1", "--seq-len", "16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "W4A16 on 30 linear(s) (down_proj)" in out
    for row in ("plain forward", "GPTQ (Hessians+round)", "AWQ search"):
        assert row in out


def test_gptq_reuse_times_a_gptq_score_reading_its_kept_roundings(tmp_path: Path, capsys, monkeypatch) -> None:
    from tests.factories import save_tiny_llama

    monkeypatch.setenv("QUANTPLAN_HOME", str(tmp_path / "mine"))  # the user's home: left as it was
    folder = save_tiny_llama(tmp_path / "tiny")
    ratios = _load("gptq_reuse").main(["--model", str(folder), "--samples", "2", "--seq-len", "16",
                                        "--cal-samples", "2", "--cal-seq-len", "16"])
    assert set(ratios) == {"kept/anew", "kept/rtn"} and all(r > 0 for r in ratios.values())
    out = capsys.readouterr().out
    assert "W4A16_GPTQ, 15 layers read as kept" in out and "kept / anew" in out
    assert os.environ["QUANTPLAN_HOME"] == str(tmp_path / "mine") and not (tmp_path / "mine").exists()


def test_moe_split_times_the_split_experts_against_transformers_own(capsys) -> None:
    ratios = _load("moe_split").main(["--experts", "4", "--top-k", "2", "--layers", "1", "--hidden", "64",
                                      "--inter", "32", "--tokens", "16", "--repeats", "1"])
    assert set(ratios) == {"split / fused", "all / split"} and all(r > 0 for r in ratios.values())
    out = capsys.readouterr().out
    difference = float(re.search(r"max \|logit difference\| split vs fused (\S+)", out).group(1))
    assert difference < 1e-4  # the split model computes what the fused one does


def test_w4afp8_scales_reencodes_as_vllm_and_reports_on_a_checkpoint(tmp_path: Path, capsys) -> None:
    """scripts/w4afp8_scales.py: a row's group scales through vLLM's convert_bf16_scales_to_fp8 by hand, and the
    script's report on a tiny safetensors checkpoint."""
    import torch
    from safetensors.torch import save_file

    ws = _load_script("w4afp8_scales")
    # factor = 1/448: 448 and 224 are E4M3 values, 134.4 rounds to 128 (steps of 16 there); /8 is exact for all three
    got = ws.vllm_w4a8_scales(torch.tensor([[1.0, 0.5, 0.3]]))
    assert torch.allclose(got, torch.tensor([[1.0, 0.5, 128 * 8 / 448 / 8]]))
    # the checkpoint's scales are compressed-tensors' amax / 7.5, in the weights' dtype
    w = torch.tensor([[7.5, -1.0, 0.0, 3.0]])
    assert torch.allclose(ws.group_scales(w, 2, torch.float32), torch.tensor([[1.0, 0.4]]))
    gen = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.down_proj.weight": torch.randn(64, 256, generator=gen).to(torch.bfloat16),
               "model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    assert ws.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 linear weights, 128 INT4 groups of 128")
    ratio = float(re.search(r"\(([\d.]+)x\)", out).group(1))
    assert 1.0 <= ratio < 1.1  # the re-encoding moves each scale by at most 1/16 of itself: a small added error
    assert ws.main([str(tmp_path / "none")]) == 2


def test_plans_page_benchmark_keeps_what_it_recomputes(capsys) -> None:
    """The kept answers are the recomputed ones: the same resolved plan, fusion groups and step time (the script
    exits 1 when the deduplicated step bound differs from the per-layer sum)."""
    pp = _load("plans_page")
    assert pp.main(["--repeat", "1", "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smollm2-135m: 211 linears")
    assert all(part in out for part in ("resolve the plan", "fusion groups of the layer names", "roofline step bound"))
    model = pp._record("qwen3-30b-a3b")
    assert len(model.linears) == 48 * (4 + 128 * 3) + 1
    body = {"default": "W4A16_G64"}
    from quantplan.services import plans as plans_svc

    first, _ = plans_svc.resolve(model, body)
    again, _ = plans_svc.resolve(model, body)
    assert again == first and again is not first  # a copy of the kept answer
    assert again == plans_svc._resolve(model, body)[0]


@pytest.mark.slow
@pytest.mark.browser
def test_page_speed_times_every_page_beside_the_floor(tmp_path: Path, capsys) -> None:
    """benchmarks/page_speed.py in its quick mode (a tiny Llama, one visit): every page, the floor and the three
    interactions are timed in the browser and printed with their ratios (the figures themselves are not checked)."""
    ps = _load("page_speed")
    if not Path(ps.CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh test installs it)")
    out_json = tmp_path / "page_speed.json"
    assert ps.main(["--quick", "--repeat", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert [p["page"] for p in data["pages"]] == list(ps.PAGES) and "outliers" in ps.PAGES
    for page in data["pages"]:
        assert page["settled_s"] > 0 and any(line.startswith(page["page"] + " ") for line in out.splitlines())
    assert data["floor"]["settled_s"] > 0 and "floor (one-line page)" in out
    timed = {(p["page"], what) for p in data["pages"] for what in p["interactions_s"]}
    assert {("outliers", "α slider step"), ("outliers", "layer pick"), ("results", "compare selection")} <= timed
    assert re.search(r"outliers: α slider step\s+[\d.]+ s\s+[\d.]+×", out)  # its ratio to the floor's step
