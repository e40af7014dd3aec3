"""quantcore.algorithms.apply: every preset on tiny Llama / Qwen2 / Gemma3, exact restore, stats, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantcore.algorithms.apply import apply_plan, quantized_model
from quantcore.algorithms.gptq import collect_hessians
from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import PlanError
from quantcore.formats.quantize import fake_quantize
from quantcore.formats.scales import scale_from_amax
from quantcore.schemes.presets import get_scheme, list_schemes
from tests.factories import linear_input_channel_max


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def block_linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


def calibration(model, ids):
    cmax = linear_input_channel_max(model, ids)
    return {n: float(v.max()) for n, v in cmax.items()}, cmax


def mean_kl(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean per-token KL(p_ref || p_approx)."""
    p = F.log_softmax(ref.double(), -1)
    q = F.log_softmax(approx.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("scheme", list_schemes())
def test_every_preset_applies_and_restores(tiny_model, tiny_input_ids, scheme):
    model = tiny_model
    ref = logits(model, tiny_input_ids)
    before = snapshot(model)
    params_before = {n: p for n, p in model.named_parameters()}
    act_amax, cmax = calibration(model, tiny_input_ids)
    plan = {n: scheme for n in block_linears(model)}
    hessians = collect_hessians(model, list(plan), tiny_input_ids) if get_scheme(scheme).gptq else None

    applied = apply_plan(model, plan, PlanInputs(act_amax=act_amax, act_channel_max=cmax, weight_hessians=hessians))
    out = logits(model, tiny_input_ids)
    assert torch.isfinite(out).all()
    if get_scheme(scheme).is_identity:
        assert applied.layers == {} and len(applied.untouched) == len(plan)
        assert torch.equal(out, ref)
    else:
        assert set(applied.layers) == set(plan)
        assert not torch.equal(out, ref)
        assert mean_kl(ref, out) < 0.05  # quantized, not broken (tiny models: KL ~1e-5..5e-3)
        stats = applied.stats()
        for name in plan:
            st = stats[name]
            assert st.weight.n_elements == model.get_submodule(name).weight.numel()
            if get_scheme(scheme).activations is None:
                assert st.activations is None and st.calls == 0  # weight-only: no activation hook
            else:
                assert st.calls == 1
                k = model.get_submodule(name).in_features
                assert st.activations.n_elements == tiny_input_ids.numel() * k

    applied.restore()
    assert torch.equal(logits(model, tiny_input_ids), ref)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # bit-exact
    assert all(p is params_before[n] for n, p in model.named_parameters())  # same Parameter objects
    applied.restore()  # idempotent


def test_weight_quantized_once_and_activation_on_every_call(tiny_llama, tiny_input_ids):
    name = "model.layers.0.mlp.down_proj"
    layer = tiny_llama.get_submodule(name)
    w0 = layer.weight.detach().clone()
    seen = {}
    layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    with quantized_model(tiny_llama, {name: "FP8_DYNAMIC"}) as applied:
        assert torch.equal(layer.weight, fake_quantize(w0, "fp8_e4m3", "channel"))
        y = {}
        h = layer.register_forward_hook(lambda m, a, out: y.__setitem__("y", out.detach().clone()))
        logits(tiny_llama, tiny_input_ids)
        logits(tiny_llama, tiny_input_ids)
        h.remove()
        # the hook we registered first sees the raw input; the layer computed on its per-token fake quant
        expected = F.linear(fake_quantize(seen["x"], "fp8_e4m3", "token"), layer.weight)
        assert torch.equal(y["y"], expected)
        assert applied.stats()[name].calls == 2
    assert torch.equal(layer.weight, w0)


def test_static_scale_uses_calibrated_amax_and_reports_saturation(tiny_llama, tiny_input_ids):
    name = "model.layers.0.self_attn.q_proj"
    act_amax, _ = calibration(tiny_llama, tiny_input_ids)
    low = {name: act_amax[name] / 4}  # calibrated on quieter traffic than we now send
    layer = tiny_llama.get_submodule(name)
    seen = {}
    layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    with quantized_model(tiny_llama, {name: "FP8"}, PlanInputs(act_amax=low)) as applied:
        y = {}
        layer.register_forward_hook(lambda m, a, out: y.__setitem__("y", out.detach().clone()))
        logits(tiny_llama, tiny_input_ids)
        s = scale_from_amax(low[name], "fp8_e4m3")
        assert torch.equal(y["y"], F.linear(fake_quantize(seen["x"], "fp8_e4m3", scale=s), layer.weight))
        sat = applied.stats()[name].activations
        assert sat.saturation > 0 and sat.n_saturated > 0
    with quantized_model(tiny_llama, {name: "FP8"}, PlanInputs(act_amax=act_amax)) as applied:
        logits(tiny_llama, tiny_input_ids)
        assert applied.stats()[name].activations.saturation == 0.0


def test_smoothquant_helps_int8_per_tensor_on_planted_outliers(tiny_llama, tiny_input_ids):
    # fp8-fp4-smoothquant.txt: per-tensor INT8 activations suffer from outlier channels; smoothing helps
    ref = logits(tiny_llama, tiny_input_ids)
    act_amax, cmax = calibration(tiny_llama, tiny_input_ids)
    names = block_linears(tiny_llama)
    with quantized_model(tiny_llama, {n: "INT8_PER_TENSOR" for n in names}):
        plain = mean_kl(ref, logits(tiny_llama, tiny_input_ids))
    with quantized_model(
        tiny_llama, {n: "INT8_PER_TENSOR_SQ" for n in names}, PlanInputs(act_channel_max=cmax)
    ) as applied:
        smoothed = mean_kl(ref, logits(tiny_llama, tiny_input_ids))
        assert applied.smoothing is not None and applied.smoothing.skipped == {}
    assert smoothed < plain / 2
    assert torch.equal(logits(tiny_llama, tiny_input_ids), ref)


def test_alpha_ignored_without_channel_max(tiny_llama, tiny_input_ids):
    names = block_linears(tiny_llama)
    with quantized_model(tiny_llama, {n: "INT8_W8A8_SQ" for n in names}) as a:
        out_sq = logits(tiny_llama, tiny_input_ids)
        assert a.smoothing is None
    with quantized_model(tiny_llama, {n: "INT8_W8A8" for n in names}):
        assert torch.equal(logits(tiny_llama, tiny_input_ids), out_sq)


def test_lm_head_and_tied_weights(tiny_model_factory, tiny_input_ids):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    emb = model.model.embed_tokens.weight.detach().clone()
    with quantized_model(model, {"lm_head": "W4A16"}):
        assert torch.equal(model.model.embed_tokens.weight, emb)  # embeddings stay 16-bit
        assert not torch.equal(model.lm_head.weight, emb)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie intact after restore


def test_bf16_model(tiny_model_factory, tiny_input_ids):
    model = tiny_model_factory("qwen2", dtype=torch.bfloat16)
    ref = logits(model, tiny_input_ids)
    # NVFP4's activations take their fp32 tensor scale from a calibrated amax
    amax = {n: 8.0 for n in block_linears(model)}
    with quantized_model(model, {n: "NVFP4" for n in block_linears(model)}, PlanInputs(act_amax=amax)) as applied:
        out = logits(model, tiny_input_ids)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        assert len(applied.layers) == 14
    assert torch.equal(logits(model, tiny_input_ids), ref)


def test_per_tensor_fp8_weights_of_a_fusion_group_share_the_largest_scale_as_vllm_requantizes_them(tiny_llama):
    """vLLM's requantize_with_max_scale: a merged q/k/v (gate/up) GEMM with per-tensor FP8 weights runs on one
    scale, the largest of the members'; each other member is dequantized and rounded again on that grid."""
    from quantcore.formats.weights import fake_quantize_weight, weight_scale

    p = "model.layers.0.self_attn"
    names = [f"{p}.{x}_proj" for x in "qkv"]
    modules = dict(tiny_llama.named_modules())
    with torch.no_grad():
        modules[f"{p}.k_proj"].weight.mul_(0.3)  # a member with a clearly smaller own scale
    originals = {n: modules[n].weight.detach().clone() for n in names}
    spec = get_scheme("FP8_PER_TENSOR").weights
    own = {n: float(weight_scale(originals[n], spec)) for n in names}
    largest = max(own.values())
    assert own[f"{p}.k_proj"] < largest
    with quantized_model(tiny_llama, {n: "FP8_PER_TENSOR" for n in names}):
        for n in names:
            w = modules[n].weight.detach()
            once = fake_quantize_weight(originals[n], spec)[0]
            assert torch.equal(fake_quantize(w, "fp8_e4m3", "tensor", scale=largest), w), n  # on the shared grid
            assert torch.equal(w, fake_quantize(once, "fp8_e4m3", "tensor", scale=largest)), n  # rounded twice
            if own[n] == largest:
                assert torch.equal(w, once), n  # the member whose scale it is: rounded once, as stored
        assert not torch.equal(modules[f"{p}.k_proj"].weight, fake_quantize_weight(originals[f"{p}.k_proj"], spec)[0])
    # per-channel scales need nothing of the kind (vLLM lines the rows' scales up as they are)
    with quantized_model(tiny_llama, {n: "FP8_DYNAMIC" for n in names}):
        k = modules[f"{p}.k_proj"].weight.detach()
        assert torch.equal(k, fake_quantize_weight(originals[f"{p}.k_proj"], get_scheme("FP8_DYNAMIC").weights)[0])


def test_nvfp4_activations_take_the_calibrated_tensor_scale_and_clip_above_it(tiny_llama, tiny_input_ids):
    """compressed-tensors' NVFP4 (dynamic: local): block scales from each live block, the fp32 tensor scale from the
    calibrated amax. An input within it is quantized as with its own amax, up to the E4M3 block scales' rounding;
    one above it saturates the block scales (E4M3's 448), and the counts say so."""
    layer = "model.layers.0.mlp.down_proj"
    seen = {}

    def record(_module, args) -> None:
        seen["amax"] = max(seen.get("amax", 0.0), float(args[0].abs().max()))

    hook = dict(tiny_llama.named_modules())[layer].register_forward_pre_hook(record)
    logits(tiny_llama, tiny_input_ids)
    hook.remove()
    ok = {layer: seen["amax"] * 1.01}
    with quantized_model(tiny_llama, {layer: "NVFP4"}, PlanInputs(act_amax=ok), track_stats=True) as applied:
        logits(tiny_llama, tiny_input_ids)
        assert applied.stats()[layer].activations.saturation == 0
    low = {layer: seen["amax"] / 100}  # a calibration that saw a hundredth of the live input
    with quantized_model(tiny_llama, {layer: "NVFP4"}, PlanInputs(act_amax=low), track_stats=True) as applied:
        logits(tiny_llama, tiny_input_ids)
        assert applied.stats()[layer].activations.saturation > 0
    with pytest.raises(PlanError, match="no calibrated amax"):
        apply_plan(tiny_llama, {layer: "NVFP4"})


def test_errors_name_the_problem(tiny_llama):
    with pytest.raises(
        PlanError, match=r"model.layers.0.self_attn.qproj.*did you mean 'model.layers.0.self_attn.q_proj'"
    ):
        apply_plan(tiny_llama, {"model.layers.0.self_attn.qproj": "FP8_DYNAMIC"})
    with pytest.raises(PlanError, match="only nn.Linear"):
        apply_plan(tiny_llama, {"model.layers.0.input_layernorm": "FP8_DYNAMIC"})
    with pytest.raises(PlanError, match="unknown scheme.*FP9"):
        apply_plan(tiny_llama, {"lm_head": "FP9"})
    with pytest.raises(PlanError, match="no calibrated amax.*model.layers.0.mlp.up_proj"):
        apply_plan(tiny_llama, {"model.layers.0.mlp.up_proj": "FP8"})
    with pytest.raises(PlanError, match="finite"):
        apply_plan(
            tiny_llama,
            {"model.layers.0.mlp.up_proj": "FP8"}, PlanInputs(act_amax={"model.layers.0.mlp.up_proj": float("nan")}),
        )
    with pytest.raises(PlanError, match="SmoothQuant needs act_channel_max"):
        apply_plan(tiny_llama, {"model.layers.0.mlp.up_proj": "INT8_W8A8_SQ"}, PlanInputs(act_channel_max={}))
    applied = apply_plan(tiny_llama, {"lm_head": "FP8_DYNAMIC"})
    with pytest.raises(PlanError, match="already carry an applied plan"):
        apply_plan(tiny_llama, {"lm_head": "W8A16"})
    applied.restore()
    apply_plan(tiny_llama, {"lm_head": "W8A16"}).restore()


def test_context_manager_restores_on_error(tiny_llama, tiny_input_ids):
    ref = logits(tiny_llama, tiny_input_ids)
    with pytest.raises(RuntimeError, match="boom"):
        with quantized_model(tiny_llama, {n: "MXFP4" for n in block_linears(tiny_llama)}):
            raise RuntimeError("boom")
    assert torch.equal(logits(tiny_llama, tiny_input_ids), ref)


def test_reset_stats_and_no_tracking(tiny_gemma3, tiny_input_ids):
    names = block_linears(tiny_gemma3)
    with quantized_model(tiny_gemma3, {n: "INT8_W8A8" for n in names}) as applied:
        tracked = logits(tiny_gemma3, tiny_input_ids)
        applied.reset_stats()
        assert applied.stats()[names[0]].calls == 0
    with quantized_model(tiny_gemma3, {n: "INT8_W8A8" for n in names}, track_stats=False) as applied:
        assert torch.equal(logits(tiny_gemma3, tiny_input_ids), tracked)
        assert applied.stats()[names[0]].activations.n_elements == 0
        assert applied.stats()[names[0]].weight.n_elements == 0  # weight counts skipped as well


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK", "INT8_W8A8", "W4A16", "W4A16_ASYM", "MXFP4", "NVFP4",
                                    "W4AFP8"])
def test_cuda_matches_cpu(tiny_model_factory, tiny_input_ids, scheme):
    cpu = tiny_model_factory("llama")
    gpu = tiny_model_factory("llama").cuda()
    plan = {n: scheme for n in block_linears(cpu)}
    amax = {n: 4.0 for n in plan}  # NVFP4's calibrated activation tensor scale (the others ignore it)
    with quantized_model(cpu, plan, PlanInputs(act_amax=amax)), quantized_model(gpu, plan, PlanInputs(act_amax=amax)):
        a = logits(cpu, tiny_input_ids)
        b = logits(gpu, tiny_input_ids.cuda()).cpu()
        for name in plan:  # weights are quantized identically on both devices
            assert torch.equal(cpu.get_submodule(name).weight, gpu.get_submodule(name).weight.cpu())
    assert torch.allclose(a, b, atol=1e-3)


def test_error_ranking_follows_the_reference(tiny_model, tiny_input_ids):
    # fp8-fp4-smoothquant.txt, measured: per-token INT8 beats per-tensor INT8; E5M2 is worse than E4M3
    # at one scale per tensor; and fewer weight bits cost more (W4A16 vs W8A16).
    ref = logits(tiny_model, tiny_input_ids)
    names = block_linears(tiny_model)
    kl = {}
    for scheme in ("INT8_PER_TENSOR", "INT8_W8A8", "FP8_PER_TENSOR", "FP8_E5M2", "W8A16", "W4A16"):
        with quantized_model(tiny_model, {n: scheme for n in names}):
            kl[scheme] = mean_kl(ref, logits(tiny_model, tiny_input_ids))
    assert kl["INT8_W8A8"] < kl["INT8_PER_TENSOR"]
    assert kl["FP8_PER_TENSOR"] < kl["FP8_E5M2"]
    assert kl["W8A16"] < kl["W4A16"]


def test_static_scale_follows_smoothing(tiny_llama, tiny_input_ids):
    # a static activation amax is calibrated on the unsmoothed input; after folding, channel j is
    # divided by s_j, so apply_plan must use max_j(channel_max_j / s_j) or the scale is wrong
    from quantcore.schemes.specs import Scheme, TensorSpec

    static_sq = Scheme(
        "INT8_STATIC_SQ",
        TensorSpec("int8", "channel"),
        TensorSpec("int8", "tensor", dynamic=False),
        smoothquant_alpha=0.5,
    )
    act_amax, cmax = calibration(tiny_llama, tiny_input_ids)
    names = block_linears(tiny_llama)
    ref = logits(tiny_llama, tiny_input_ids)
    with quantized_model(
        tiny_llama, {n: static_sq for n in names}, PlanInputs(act_amax=act_amax, act_channel_max=cmax)
    ) as a:
        static_kl = mean_kl(ref, logits(tiny_llama, tiny_input_ids))
        stats = a.stats()
        # block 0's q/k/v read the embeddings through one norm: no upstream quantization noise, so
        # live traffic equals calibration exactly and nothing may saturate
        first = [n for n in names if n.startswith("model.layers.0.self_attn.") and not n.endswith("o_proj")]
        assert len(first) == 3 and all(stats[n].activations.n_saturated == 0 for n in first)
        s = a.smoothing.factors[names[0]]
        assert a._states[names[0]].static_scale == pytest.approx(
            float((cmax[names[0]] / s).max()) / 127, rel=1e-6
        )
    with quantized_model(tiny_llama, {n: "INT8_PER_TENSOR_SQ" for n in names}, PlanInputs(act_channel_max=cmax)):
        dynamic_kl = mean_kl(ref, logits(tiny_llama, tiny_input_ids))
    # calibrated on this very input, the static scales are about as good as live per-tensor ones
    # (later layers differ a little: calibration saw unquantized upstream activations)
    assert static_kl < 2 * dynamic_kl


# ------------------------------------------------------------------ one quantization per shared input


def _counting(monkeypatch):
    """Count the activation fake-quantizations the hooks compute (cache hits are not counted)."""
    import quantcore.algorithms.apply as apply_mod

    calls = {"n": 0}
    for fn_name in ("fake_quantize", "fake_quantize_with_counts"):
        real = getattr(apply_mod, fn_name)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(apply_mod, fn_name, counted)
    return calls


def _stats_tuple(applied):
    out = {}
    for name, st in applied.stats().items():
        a = st.activations
        out[name] = (
            st.calls,
            None if a is None else (a.n_elements, a.n_nonzero, a.n_saturated, a.n_underflow, a.n_nan),
        )
    return out


@pytest.mark.parametrize("track_stats", [True, False])
def test_shared_inputs_quantized_once_with_identical_results(
    tiny_model, tiny_input_ids, monkeypatch, track_stats
):
    names = block_linears(tiny_model)
    act_amax, _ = calibration(tiny_model, tiny_input_ids)
    # q/k/v and gate/up read one tensor each; a mix of dynamic and static (calibrated) specs, and a
    # group whose members disagree (k_proj INT8), which must not share with q/v
    plan = {n: ("FP8" if ".mlp." in n else "FP8_DYNAMIC") for n in names}
    plan["model.layers.1.self_attn.k_proj"] = "INT8_W8A8"
    results = {}
    for share in (False, True):
        calls = _counting(monkeypatch)
        with quantized_model(
            tiny_model, plan, PlanInputs(act_amax=act_amax), track_stats=track_stats, share_inputs=share
        ) as applied:
            calls["n"] = 0  # count the forwards only, not the weights quantized at apply
            out = logits(tiny_model, tiny_input_ids)
            out2 = logits(tiny_model, tiny_input_ids)  # a second forward: new tensors, no stale hits
            results[share] = (out, out2, _stats_tuple(applied), calls["n"])
        monkeypatch.undo()
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert torch.equal(results[True][0], results[True][1])
    assert results[True][2] == results[False][2]  # calls and counts per layer, as if computed per layer
    # without sharing: 7 per block per forward; with: q/k/v once, o, gate/up once, down (+1 for k in
    # block 1, whose spec differs): 4 per block, 5 in block 1
    assert results[False][3] == 2 * 7 * len(tiny_model.model.layers)
    assert results[True][3] == 2 * (4 * len(tiny_model.model.layers) + 1)


class _ThreeReaders(nn.Module):
    """Three linears reading one tensor, which is scaled in place between the second and third."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(32, 8), nn.Linear(32, 8), nn.Linear(32, 8)

    def forward(self, x):
        ya, yb = self.a(x), self.b(x)
        x.mul_(3.0)  # in place: the cached quantization of x is stale now
        return ya, yb, self.c(x)


def test_shared_inputs_respect_in_place_changes():
    model = _ThreeReaders().eval()
    x0 = torch.randn(4, 32) * 5
    plan = {"a": "FP8_DYNAMIC", "b": "FP8_DYNAMIC", "c": "FP8_DYNAMIC"}

    # a pre-hook that writes into the quantized input it receives: later readers must not see it
    def vandal(module, args):
        args[0].add_(1.0)

    with quantized_model(model, plan) as applied:
        handle = model.a.register_forward_pre_hook(vandal)  # runs after the quantizing hook
        with torch.no_grad():
            ya, yb, yc = model(x0.clone())
        handle.remove()
        assert applied.stats()["c"].calls == 1
        w = {n: getattr(model, n).weight for n in "abc"}
    xq = fake_quantize(x0, "fp8_e4m3", "token")
    assert torch.equal(ya, F.linear(xq + 1.0, w["a"], model.a.bias))
    assert torch.equal(yb, F.linear(xq, w["b"], model.b.bias))  # not a's vandalised copy
    assert torch.equal(yc, F.linear(fake_quantize(x0 * 3.0, "fp8_e4m3", "token"), w["c"], model.c.bias))


def test_shared_inputs_under_inference_mode(tiny_llama, tiny_input_ids, monkeypatch):
    # inference tensors carry no version counter: nothing is cached, results are unchanged
    plan = {n: "FP8_DYNAMIC" for n in block_linears(tiny_llama)}
    with quantized_model(tiny_llama, plan):
        expected = logits(tiny_llama, tiny_input_ids)
        calls = _counting(monkeypatch)
        with torch.inference_mode():
            got = tiny_llama(tiny_input_ids).logits
    assert torch.equal(got, expected)
    assert calls["n"] == len(plan)


def test_nvfp4_fusion_groups_share_one_tensor_scale(tiny_llama, tiny_input_ids):
    """q/k/v and gate/up in NVFP4 take one fp32 tensor scale, from the group's largest |W| (what the checkpoint
    stores and vLLM's fused GEMM reads); o_proj and down_proj keep their own; GPTQ rounds on the same scales."""
    from quantcore.algorithms.gptq import gptq_quantize
    from quantcore.formats.weights import fake_quantize_weight, fused_tensor_scale, weight_scale

    model = tiny_llama
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    names = [f"{attn}.{p}_proj" for p in "qkvo"] + [f"{mlp}.{p}_proj" for p in ("gate", "up", "down")]
    w = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    spec = get_scheme("NVFP4A16").weights
    qkv = [f"{attn}.{p}_proj" for p in "qkv"]
    g_qkv = fused_tensor_scale(w[n] for n in qkv)
    assert torch.equal(g_qkv, scale_from_amax(max(float(w[n].abs().max()) for n in qkv), "nvfp4"))
    with quantized_model(model, dict.fromkeys(names, "NVFP4A16")):
        got = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    for n in qkv:
        assert torch.equal(got[n], fake_quantize_weight(w[n], spec, scale=g_qkv, report=False)[0]), n
    for n in (f"{attn}.o_proj", f"{mlp}.down_proj"):
        assert torch.equal(got[n], fake_quantize_weight(w[n], spec, report=False)[0]), n
    gate_up = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
    small = min(gate_up, key=lambda n: float(w[n].abs().max()))  # the member whose own scale would differ
    assert not torch.equal(got[small], fake_quantize_weight(w[small], spec, report=False)[0])
    # GPTQ keeps the fused scales: its weights sit on the grid of g_group's effective block scales
    hess = collect_hessians(model, qkv, tiny_input_ids)
    with quantized_model(model, dict.fromkeys(qkv, "NVFP4A16_GPTQ"), PlanInputs(weight_hessians=hess)):
        k = model.get_submodule(qkv[1]).weight.detach().clone()
    scale = weight_scale(w[qkv[1]], spec, tensor_scale=g_qkv)
    assert torch.equal(k, gptq_quantize(w[qkv[1]], hess[qkv[1]], spec, scale=scale).weight)


def test_on_several_gpus_each_takes_its_dynamic_scale_over_its_share_of_a_row_parallel_input(tiny_llama,
                                                                                             tiny_input_ids):
    """Served over 2 GPUs, o_proj and down_proj (row-parallel: each GPU reads half of K) quantize each half of their
    input on its own dynamic scale, per tensor or per token, as each GPU's kernel computes it from its own share;
    q/k/v and gate/up (column-parallel: the whole input on every GPU), static scales (one calibrated number every
    GPU loads) and group scales are the same as on one GPU. With one GPU nothing changes."""
    from quantcore.models.parallel import Parallelism

    names = block_linears(tiny_llama)
    amax, _ = calibration(tiny_llama, tiny_input_ids)
    seen: dict[str, list[torch.Tensor]] = {}

    def inputs(scheme: str, parallel) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (its raw input, the input it computes with)} for one forward under the plan."""
        seen.clear()
        raw = [tiny_llama.get_submodule(n).register_forward_pre_hook(
            lambda _m, a, _n=n: seen.setdefault(_n, []).append(a[0].detach().clone())) for n in names]
        with quantized_model(tiny_llama, dict.fromkeys(names, scheme), PlanInputs(act_amax=amax, parallel=parallel)):
            after = [tiny_llama.get_submodule(n).register_forward_pre_hook(  # after the plan's own hook
                lambda _m, a, _n=n: seen[_n].append(a[0].detach().clone())) for n in names]
            logits(tiny_llama, tiny_input_ids)
            for h in after:
                h.remove()
        for h in raw:
            h.remove()
        return {n: tuple(seen[n]) for n in names}

    def halves(x: torch.Tensor, fmt: str, granularity: str) -> torch.Tensor:
        return torch.cat([fake_quantize(p, fmt, granularity) for p in x.tensor_split(2, dim=-1)], dim=-1)

    for scheme, fmt, granularity in (("INT8_PER_TENSOR", "int8", "tensor"), ("INT8_W8A8", "int8", "token"),
                                     ("FP8_PER_TENSOR", "fp8_e4m3", "tensor")):
        one, two = inputs(scheme, None), inputs(scheme, Parallelism(2))
        tp1 = inputs(scheme, Parallelism(1))
        assert all(torch.equal(tp1[n][1], one[n][1]) for n in names), scheme
        for n in names:
            x, got = two[n]
            if n.endswith(("o_proj", "down_proj")):
                torch.testing.assert_close(got, halves(x, fmt, granularity), rtol=0, atol=0)
            else:
                torch.testing.assert_close(got, fake_quantize(x, fmt, granularity), rtol=0, atol=0)
        down = "model.layers.0.mlp.down_proj"  # the planted outlier is in one half: the other half gains
        if granularity == "tensor":
            assert not torch.equal(two[down][1], one[down][1])
    for scheme in ("FP8", "MXFP8", "W4A16"):  # static, group and weight-only: as on one GPU
        one, two = inputs(scheme, None), inputs(scheme, Parallelism(2))
        assert all(torch.equal(one[n][1], two[n][1]) for n in names), scheme
