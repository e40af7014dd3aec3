"""GPTQ weight rounding (quantcore.algorithms.gptq): the algorithm, its Hessians, and GPTQ schemes in plans, scores
and sweeps."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from quantcore.algorithms.apply import apply_plan
from quantcore.algorithms.gptq import collect_hessians, gptq_quantize, smoothed_hessian
from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import PlanError
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import score_plan
from quantcore.evaluation.sensitivity import sensitivity_sweep
from quantcore.formats.weights import (
    element_scales,
    fake_quantize_weight,
    round_to_weight_grid,
    weight_scale,
    weight_zero_point,
)
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Scheme
from tests.factories import TINY_VOCAB

REPO = Path(__file__).resolve().parents[3]
LLMC_PYTHON = REPO / ".venv-llmc" / "bin" / "python"


def correlated_inputs(k: int, n: int = 2048, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels are correlated and differ in size, as a linear layer's are."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 2 * torch.randn(k, k, generator=gen) / k**0.5
    x = torch.randn(n, k, generator=gen) @ mix
    x[:, 3] *= 20  # one outlier channel
    return x


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T @ x / x.shape[0]


def weight(n: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def rtn(w: torch.Tensor, spec, scale=None) -> torch.Tensor:
    """Round to nearest on the grid the checkpoint stores (quantcore.formats.weights.fake_quantize_weight)."""
    return fake_quantize_weight(w, spec, scale=scale)[0]


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float(((x @ (w - q).T) ** 2).mean())


GPTQ_FORMATS = ["W4A16", "W8A16", "INT8_W8A8", "FP8_DYNAMIC", "FP8_PER_TENSOR", "FP8_BLOCK", "NVFP4A16"]


@pytest.mark.parametrize("name", GPTQ_FORMATS)
def test_diagonal_hessian_is_round_to_nearest_bit_for_bit(name):
    """No correlation between inputs: no error to propagate, so GPTQ must give RTN's weight exactly."""
    spec = get_scheme(name).weights
    w = weight(192, 320)
    diag = torch.diag(torch.rand(320, generator=torch.Generator().manual_seed(2)) + 0.5)
    assert torch.equal(gptq_quantize(w, diag, spec).weight, rtn(w, spec))


@pytest.mark.parametrize("name", GPTQ_FORMATS)
def test_gptq_lowers_the_output_error_and_stays_on_rtn_grid(name):
    spec = get_scheme(name).weights
    x = correlated_inputs(320)
    w = weight(192, 320)
    res = gptq_quantize(w, hessian_of(x), spec)
    nearest = rtn(w, spec)
    assert not res.rtn_fallback and res.dead == 0
    assert output_error(x, w, res.weight) < 0.6 * output_error(x, w, nearest)
    assert not torch.equal(res.weight, nearest)
    # the same scales: rounding the GPTQ weight again with RTN's scales changes nothing
    S = element_scales(weight_scale(w, spec), spec, tuple(w.shape))
    assert torch.equal(round_to_weight_grid(res.weight / S, spec.format) * S, res.weight)


def test_an_all_zero_nvfp4_block_stays_zero():
    """Its block scale is 0; GPTQ pushes other columns' error into it, which must round to zero, not to NaN."""
    spec = get_scheme("NVFP4A16").weights
    x = correlated_inputs(64)
    w = weight(8, 64)
    w[:, 16:32] = 0
    res = gptq_quantize(w, hessian_of(x), spec)
    assert torch.isfinite(res.weight).all()
    assert res.weight[:, 16:32].abs().max() < 1e-30
    assert output_error(x, w, res.weight) < output_error(x, w, rtn(w, spec))
    # no error to push (a diagonal Hessian): its zeros stay exactly zero, as round-to-nearest leaves them
    assert torch.equal(gptq_quantize(w, torch.diag(torch.diagonal(hessian_of(x))), spec).weight, rtn(w, spec))


def test_lazy_block_updates_equal_column_by_column():
    spec = get_scheme("W4A16").weights
    x = correlated_inputs(256)
    w = weight(64, 256)
    h = hessian_of(x)
    one = gptq_quantize(w, h, spec, block_size=1).weight
    for bs in (32, 128, 256):
        other = gptq_quantize(w, h, spec, block_size=bs).weight
        # the same algorithm in another order of float additions: a weight on a rounding tie may flip
        assert (other != one).float().mean() < 0.002, bs


def test_dead_channels_get_zero_weight_and_activation_order_is_optional():
    spec = get_scheme("W8A16").weights
    x = correlated_inputs(128)
    x[:, 10] = 0.0
    w = weight(32, 128)
    h = hessian_of(x)
    res = gptq_quantize(w, h, spec)
    assert res.dead == 1 and torch.all(res.weight[:, 10] == 0)
    plain = gptq_quantize(w, h, spec, actorder=False).weight
    assert output_error(x, w, plain) < output_error(x, w, rtn(w, spec))


def test_bad_shapes_and_formats_are_refused():
    spec = get_scheme("W4A16").weights
    with pytest.raises(ValueError, match=r"\(64, 64\)"):
        gptq_quantize(weight(8, 64), torch.eye(32), spec)
    with pytest.raises(ValueError, match="2-D"):
        gptq_quantize(torch.zeros(64), torch.eye(64), spec)
    with pytest.raises(PlanError, match="mxfp4"):
        gptq_quantize(weight(8, 64), torch.eye(64), get_scheme("MXFP4").weights)
    with pytest.raises(ValueError, match="block scales"):
        Scheme("X", get_scheme("MXFP4").weights, None, gptq=True)
    with pytest.raises(ValueError, match="leaves them unquantized"):
        Scheme("X", None, None, gptq=True)


def test_gptq_presets_and_their_dicts():
    for name in ("W4A16_GPTQ", "W8A16_GPTQ", "INT8_W8A8_GPTQ", "INT8_W8A8_SQ_GPTQ", "NVFP4A16_GPTQ", "NVFP4_GPTQ"):
        s = get_scheme(name)
        assert s.gptq and s.needs_hessians and name in list_schemes()
        assert s.weights == get_scheme(name.removesuffix("_GPTQ")).weights
        assert Scheme.from_dict(s.to_dict()) == s
        assert s.describe().endswith("GPTQ")
    old = get_scheme("W4A16").to_dict()
    del old["gptq"]  # a scheme stored before GPTQ existed
    assert Scheme.from_dict(old) == get_scheme("W4A16")
    assert not get_scheme("BF16").needs_hessians


def test_smoothed_hessian_is_the_hessian_of_the_smoothed_input():
    x = correlated_inputs(64)
    s = torch.rand(64, generator=torch.Generator().manual_seed(5)) + 0.2
    assert torch.allclose(smoothed_hessian(hessian_of(x), s), hessian_of(x / s), rtol=1e-4, atol=1e-4)


def test_collect_hessians_matches_the_definition_and_shares_fused_inputs(tiny_llama, tiny_input_ids):
    model = tiny_llama
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, a, _n=n: seen.setdefault(_n, []).append(a[0].detach()))
             for n, m in model.named_modules() if n in names]
    with torch.no_grad():
        model(input_ids=tiny_input_ids[:1])
        model(input_ids=tiny_input_ids[1:])
    for h in hooks:
        h.remove()
    hess = collect_hessians(model, names, tiny_input_ids, batch_size=1)
    for n in names:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen[n]])
        assert torch.allclose(hess[n], hessian_of(x.float()), rtol=1e-4, atol=1e-5), n
    q, k, v = (f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert hess[q] is hess[k] is hess[v]
    assert hess["model.layers.0.self_attn.o_proj"] is not hess[q]
    with pytest.raises(PlanError, match="nn.Linear"):
        collect_hessians(model, ["model.norm"], tiny_input_ids)


def test_collect_hessians_can_stop_after_the_block_it_needs(tiny_llama, tiny_input_ids):
    """stop_after ends each forward once the given block has run: the same Hessians, nothing after it runs."""
    model = tiny_llama
    block = model.model.layers[0]
    names = [n for n, m in block.named_modules(prefix="model.layers.0") if isinstance(m, torch.nn.Linear)]
    ran_after: list[int] = []
    hook = model.lm_head.register_forward_pre_hook(lambda *_: ran_after.append(1))
    try:
        full = collect_hessians(model, names, tiny_input_ids, batch_size=1)
        assert len(ran_after) == tiny_input_ids.shape[0]
        ran_after.clear()
        early = collect_hessians(model, names, tiny_input_ids, batch_size=1, stop_after=block)
    finally:
        hook.remove()
    assert ran_after == []
    assert all(torch.equal(full[n], early[n]) for n in names)
    assert not block._forward_hooks  # its stop hook is gone


def test_apply_plan_needs_hessians_and_restores_exactly(tiny_llama, tiny_input_ids):
    model = tiny_llama
    layer = "model.layers.0.mlp.down_proj"
    before = model.get_submodule(layer).weight.detach().clone()
    with pytest.raises(PlanError, match="GPTQ"):
        apply_plan(model, {layer: "W4A16_GPTQ"})
    assert torch.equal(model.get_submodule(layer).weight, before)
    hess = collect_hessians(model, [layer], tiny_input_ids)
    applied = apply_plan(model, {layer: "W4A16_GPTQ"}, PlanInputs(weight_hessians=hess))
    got = model.get_submodule(layer).weight.detach().clone()
    applied.restore()
    assert torch.equal(model.get_submodule(layer).weight, before)
    assert torch.equal(got, gptq_quantize(before, hess[layer], get_scheme("W4A16").weights).weight)
    assert not torch.equal(got, rtn(before, get_scheme("W4A16").weights))


def test_smoothquant_gptq_plan_uses_the_transformed_hessian(tiny_llama, tiny_input_ids, channel_max_of):
    """INT8_W8A8_SQ_GPTQ: smoothing first, then GPTQ of the smoothed weight with the smoothed input's Hessian."""
    from quantcore.evaluation.scoring import plan_applied

    model = tiny_llama
    group = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up")]
    cmax = channel_max_of(model, tiny_input_ids)
    hess = collect_hessians(model, group, tiny_input_ids)
    with plan_applied(model, dict.fromkeys(group, "INT8_W8A8_SQ_GPTQ"),
                      inputs=PlanInputs(act_channel_max=cmax, weight_hessians=hess)) as ctx:
        s = ctx.smoothing[group[0]]
        got = model.get_submodule(group[0]).weight.detach().clone()
    w_smoothed = model.get_submodule(group[0]).weight.detach() * s
    want = gptq_quantize(w_smoothed, smoothed_hessian(hess[group[0]], s), get_scheme("INT8_W8A8").weights).weight
    assert torch.allclose(got, want, atol=1e-6)


def test_gptq_scores_lower_kl_than_rtn_and_sweeps_round_once(tiny_llama, tiny_input_ids, monkeypatch):
    """On the tiny model with planted outliers, W4A16 with GPTQ is closer to the unquantized model than W4A16;
    a sweep rounds every unit once, however many batches it scores."""
    import quantcore.algorithms.gptq as gptq_mod  # round_with_gptq calls gptq_quantize from there

    model = tiny_llama
    gen = torch.Generator().manual_seed(7)
    cal = torch.randint(0, TINY_VOCAB, (8, 32), generator=gen)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    hess = collect_hessians(model, names, cal)
    ref = compute_reference(model, tiny_input_ids, batch_size=1)
    rtn = score_plan(model, dict.fromkeys(names, "W4A16"), tiny_input_ids, ref)
    gptq = score_plan(model, dict.fromkeys(names, "W4A16_GPTQ"), tiny_input_ids, ref,
                      inputs=PlanInputs(weight_hessians=hess))
    assert gptq.kl_mean < 0.8 * rtn.kl_mean

    calls: list[int] = []
    real = gptq_mod.gptq_quantize
    monkeypatch.setattr(gptq_mod, "gptq_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    only = [n for n in names if ".layers.0." in n]
    rows = sensitivity_sweep(model, "W4A16_GPTQ", tiny_input_ids, ref, layers=only,
                             inputs=PlanInputs(weight_hessians=hess))
    assert ref.batch_size == 1 and tiny_input_ids.shape[0] == 2  # two batches per unit
    assert len(calls) == len(only) and {n for r in rows for n in r.layers} == set(only)
    with pytest.raises(PlanError, match="GPTQ"):
        sensitivity_sweep(model, "W4A16_GPTQ", tiny_input_ids, ref, layers=only)


@pytest.mark.slow
def test_same_weights_as_llm_compressors_gptq(tmp_path):
    """llm-compressor 0.14's own quantize_weight (in .venv-llmc), given the same weight, Hessian and scales."""
    from safetensors.torch import load_file, save_file

    env = subprocess.run(["bash", str(REPO / "scripts" / "llmc_env.sh")], capture_output=True, text=True,
                         timeout=1800, cwd=REPO)
    assert env.returncode == 0, env.stderr[-3000:]
    cases = {"w4_group": ("W4A16", 4, 128), "w8_channel": ("W8A16", 8, 0), "nvfp4": ("NVFP4A16", 4, 16),
             "w4_group_asym": ("W4A16_ASYM", 4, 128)}
    tensors, ours = {}, {}
    for i, (case, (scheme, bits, group)) in enumerate(cases.items()):
        spec = get_scheme(scheme).weights
        x = correlated_inputs(384, seed=10 + i)
        w = weight(96, 384, seed=20 + i)
        h = hessian_of(x)
        # the scales llm-compressor's min-max observer computes: amax / 7.5 (INT4), amax / 127.5 (INT8); NVFP4's
        # effective block scales (E4M3 block scale x fp32 tensor scale)
        scale = weight_scale(w, spec)
        if not spec.symmetric:  # (max - min) / 15 and a zero point per group
            w = w + 0.01 * torch.arange(96).unsqueeze(1)  # rows off centre, so that the zero points differ
            scale = weight_scale(w, spec)
            tensors[f"{case}.zp"] = weight_zero_point(w, spec).reshape(96, -1)
        tensors.update({f"{case}.weight": w, f"{case}.hessian": h, f"{case}.scale": scale.reshape(96, -1),
                        f"{case}.args": torch.tensor([bits, group, int(scheme == "NVFP4A16"), int(spec.symmetric)])})
        ours[case] = (gptq_quantize(w, h, spec).weight, rtn(w, spec), x, w)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "in.safetensors")
    run = subprocess.run([str(LLMC_PYTHON), str(REPO / "scripts" / "llmc_gptq.py"), str(tmp_path / "in.safetensors"),
                          str(tmp_path / "out.safetensors")], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(tmp_path / "out.safetensors")
    for case, (scheme, _, _) in cases.items():  # round to nearest: the same scales and weights as compressed-tensors
        spec = get_scheme(scheme).weights
        w = tensors[f"{case}.weight"]
        # (NVFP4: compressed-tensors divides by 448·6 / amax where quantcore multiplies by amax / (448·6): the
        # effective scales may differ in the last bit of the fp32 tensor scale)
        torch.testing.assert_close(weight_scale(w, spec).reshape(96, -1), theirs[f"{case}.ct_scale"].float(),
                                   rtol=1e-6, atol=0)
        zp = weight_zero_point(w, spec)
        assert torch.equal(theirs[f"{case}.ct_zp"], torch.zeros(96, theirs[f"{case}.ct_zp"].shape[1]) if zp is None
                           else zp.reshape(96, -1)), case
        if zp is not None:
            assert len(zp.unique()) > 1, "the zero points should differ between rows"
        assert (rtn(w, spec) != theirs[f"{case}.ct_rtn"]).float().mean() < 1e-3, case
    for case, (mine, rtn_w, x, w) in ours.items():
        other = theirs[f"{case}.weight"]
        assert int(theirs[f"{case}.fallback"]) == 0
        # the same weights bit for bit here (0 of 96 rows differ); another BLAS may order a sum differently, put a
        # weight on the other side of a rounding tie and send the rest of its row down another path: one row, no more
        assert int((other != mine).any(dim=1).sum()) <= 1, case
        assert output_error(x, w, mine) == pytest.approx(output_error(x, w, other), rel=0.01)
        assert output_error(x, w, other) < 0.6 * output_error(x, w, rtn_w)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "NVFP4A16"])
def test_cuda_gptq_matches_cpu(name):
    """GPTQ on CUDA picks the CPU's grid points (a rounding tie may fall the other way and send the rest of its
    row down another path) and gives the same output error; Hessians collected on CUDA are the CPU's."""
    spec = get_scheme(name).weights
    x = correlated_inputs(320)
    w = weight(192, 320)
    h = hessian_of(x)
    cpu = gptq_quantize(w, h, spec).weight
    gpu = gptq_quantize(w.cuda(), h.cuda(), spec).weight
    assert gpu.device.type == "cuda"
    gpu = gpu.cpu()
    assert (gpu != cpu).any(dim=1).float().mean() <= 0.05
    assert output_error(x, w, gpu) == pytest.approx(output_error(x, w, cpu), rel=0.02)


@pytest.mark.gpu
def test_cuda_hessians_match_cpu(tiny_input_ids):
    from tests.factories import build_tiny_model

    cpu = build_tiny_model("llama")
    gpu = build_tiny_model("llama").cuda()
    names = [n for n, m in cpu.named_modules() if isinstance(m, torch.nn.Linear)]
    on_cpu = collect_hessians(cpu, names, tiny_input_ids)
    on_gpu = collect_hessians(gpu, names, tiny_input_ids.cuda())
    for n in names:
        assert on_gpu[n].device.type == "cuda"
        torch.testing.assert_close(on_gpu[n].cpu(), on_cpu[n], rtol=1e-3, atol=1e-4)
