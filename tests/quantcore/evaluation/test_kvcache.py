"""KV cache formats: the registry, the memory arithmetic, and the emulation inside transformers' attention."""

from __future__ import annotations

import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import PlanError
from quantcore.evaluation import kvcache
from quantcore.evaluation.kvcache import (
    KV_FORMATS,
    KvAmax,
    get_kv_format,
    kv_amax_observed,
    kv_bytes_per_token,
    kv_cache_quantized,
    kv_elements_per_token,
    kv_token_capacity,
)
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import calibrate_kv_cache, score_plan
from quantcore.models.decoder import attention_modules
from quantcore.planning.plans import PlanSpec
from tests.factories import TINY_ARCHS, TINY_HEAD_DIM, TINY_KV_HEADS, TINY_LAYERS, build_tiny_model

E4M3_MAX = 448.0

# ---------------------------------------------------------------------- registry and plan files


def test_format_names_and_errors() -> None:
    assert list(KV_FORMATS) == ["AUTO", "FP8", "FP8_UNSCALED", "FP8_E5M2", "FP8_ATTN", "FP8_ATTN_UNSCALED",
                                "FP8_ATTN_HEAD"]
    assert get_kv_format(None).name == get_kv_format("auto").name == "AUTO"
    assert get_kv_format(" fp8_e5m2 ").vllm_dtype == "fp8_e5m2"
    assert get_kv_format("FP8").calibrated and not get_kv_format("FP8_UNSCALED").calibrated
    assert {f.vllm_dtype for f in KV_FORMATS.values()} == {"auto", "fp8", "fp8_e5m2"}
    # FP8 attention: the same E4M3 cache and vLLM flag, Q and P in E4M3 as well
    assert [f.name for f in KV_FORMATS.values() if f.attention] == ["FP8_ATTN", "FP8_ATTN_UNSCALED", "FP8_ATTN_HEAD"]
    # per-head scales exist in vLLM only on FlashAttention 3, which runs attention in FP8: no cache-only variant
    assert [f.name for f in KV_FORMATS.values() if f.per_head] == ["FP8_ATTN_HEAD"]
    assert get_kv_format("fp8_attn_head").calibrated
    assert get_kv_format("fp8_attn").calibrated and not get_kv_format("FP8_ATTN_UNSCALED").calibrated
    assert all(f.element == "fp8_e4m3" and f.vllm_dtype == "fp8" for f in KV_FORMATS.values() if f.attention)
    with pytest.raises(PlanError, match=r"unknown KV cache format 'int8'; known: AUTO, FP8, FP8_UNSCALED, FP8_E5M2"):
        get_kv_format("int8")


def test_plan_files_carry_the_kv_cache() -> None:
    spec = PlanSpec.from_yaml("default: FP8_DYNAMIC\nkv_cache: fp8\n")
    assert spec.kv_cache == "FP8" and spec.to_dict()["kv_cache"] == "FP8"
    assert PlanSpec.from_yaml(spec.to_yaml()) == spec
    # AUTO is the default and is not written, so plans saved before KV formats existed read the same
    plain = PlanSpec.from_yaml("default: FP8_DYNAMIC\n")
    assert plain.kv_cache == "AUTO" and "kv_cache" not in plain.to_dict()
    with pytest.raises(PlanError, match="'kv_cache': unknown KV cache format 'fp4'"):
        PlanSpec.from_yaml("default: FP8\nkv_cache: fp4\n")


def test_module_is_torch_free_at_import() -> None:
    import subprocess
    import sys

    code = "import sys, quantcore.evaluation.kvcache, quantcore.planning.plans; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# ---------------------------------------------------------------------- memory


def _linears(blocks: int, kv_width: int, *, fused: bool = False) -> list[dict]:
    out = []
    for b in range(blocks):
        p = f"model.layers.{b}.self_attn."
        if fused:
            out.append({"name": p + "qkv_proj", "out_features": 3 * kv_width})
        else:
            out += [{"name": p + "q_proj", "out_features": 4 * kv_width},
                    {"name": p + "k_proj", "out_features": kv_width},
                    {"name": p + "v_proj", "out_features": kv_width}]
        out.append({"name": f"model.layers.{b}.mlp.down_proj", "out_features": 999})
    return out


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    # Llama 3 8B: 32 layers, 8 KV heads × 128: 128 KiB per token in BF16 (the figure vLLM users quote)
    lin = _linears(32, 8 * 128)
    assert kv_elements_per_token(lin) == 32 * 2 * 8 * 128
    assert kv_bytes_per_token(lin, "AUTO") == 128 * 1024
    assert kv_bytes_per_token(lin, "FP8") == kv_bytes_per_token(lin, "FP8_E5M2") == 64 * 1024
    assert kv_bytes_per_token(lin, "AUTO", model_bytes=4) == 256 * 1024
    assert kv_elements_per_token(_linears(4, 64, fused=True)) is None  # the split of a fused qkv is unknown
    assert kv_bytes_per_token([], "FP8") is None


def test_token_capacity() -> None:
    # 80 GB at 90 %: 72e9 bytes; 16e9 of weights leave 56e9 for 128 KiB tokens
    assert kv_token_capacity(80, 16e9, 131072) == int(56e9 // 131072)
    assert kv_token_capacity(80, 16e9, 65536) == int(56e9 // 65536)  # FP8: twice the tokens, up to rounding
    assert kv_token_capacity(24, 30e9, 1024) == 0  # the weights alone do not fit
    with pytest.raises(ValueError):
        kv_token_capacity(80, 0, 0)


# ---------------------------------------------------------------------- emulation


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def spy(monkeypatch):
    """Record the K and V that reach the model's own sdpa attention function (inside our wrapper)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((key.detach().clone(), value.detach().clone()))
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", recording)
    return seen


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_auto_and_observation_leave_the_model_bit_identical(arch: str) -> None:
    model = build_tiny_model(arch)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        with kv_cache_quantized(model, "AUTO"):
            assert torch.equal(model(ids).logits, ref)
        with kv_amax_observed(model) as amax:
            assert torch.equal(model(ids).logits, ref)
    assert model.config._attn_implementation == "sdpa"
    assert set(amax.k) == set(amax.v) == {f"model.layers.{i}.self_attn" for i in range(TINY_LAYERS)}
    assert all(v > 0 for v in [*amax.k.values(), *amax.v.values()])


def test_observed_amax_is_the_max_of_the_cached_k_and_v(spy) -> None:
    model = build_tiny_model("llama")
    with torch.no_grad(), kv_amax_observed(model) as amax:
        model(_ids(1))
        model(_ids(2))
    assert len(spy) == 2 * TINY_LAYERS
    for i in range(TINY_LAYERS):
        ks = [k for n, (k, _) in enumerate(spy) if n % TINY_LAYERS == i]
        vs = [v for n, (_, v) in enumerate(spy) if n % TINY_LAYERS == i]
        assert ks[0].shape == (2, TINY_KV_HEADS, 16, TINY_HEAD_DIM)  # post-rotary, before the GQA repeat
        assert amax.k[f"model.layers.{i}.self_attn"] == max(float(k.abs().max()) for k in ks)
        assert amax.v[f"model.layers.{i}.self_attn"] == max(float(v.abs().max()) for v in vs)


@pytest.mark.parametrize("name, element", [("FP8_UNSCALED", torch.float8_e4m3fn), ("FP8_E5M2", torch.float8_e5m2)])
def test_unscaled_formats_put_k_and_v_on_the_fp8_grid(spy, name: str, element) -> None:
    model = build_tiny_model("qwen2")
    with torch.no_grad():
        model(_ids())
        plain = list(spy)
        spy.clear()
        with kv_cache_quantized(model, name) as applied:
            model(_ids())
    assert applied.k_scale == dict.fromkeys(applied.k_scale, 1.0)
    assert len(spy) == len(plain) == TINY_LAYERS
    # the first layer sees the same K and V as without the format: it gets the very values torch's own cast
    # gives (round to nearest even, scale 1); later layers see inputs the format already changed
    (k0, v0), (k, v) = plain[0], spy[0]
    assert torch.equal(k, k0.to(element).float()) and torch.equal(v, v0.to(element).float())
    assert not torch.equal(k, k0)
    for k, v in spy:
        assert torch.equal(k, k.to(element).float()) and torch.equal(v, v.to(element).float())
    assert applied.saturation == dict.fromkeys(applied.k_scale, 0.0)


def test_calibrated_fp8_uses_amax_over_448_and_counts_clipping(spy) -> None:
    model = build_tiny_model("llama")
    ids = _ids()
    with torch.no_grad(), kv_amax_observed(model) as amax:
        model(ids)
    spy.clear()
    halved = KvAmax(k={n: a / 2 for n, a in amax.k.items()}, v=dict(amax.v))
    with torch.no_grad(), kv_cache_quantized(model, "FP8", amax=halved) as applied:
        model(ids)
    for i, (k, v) in enumerate(spy):
        layer = f"model.layers.{i}.self_attn"
        ks, vs = applied.k_scale[layer], applied.v_scale[layer]
        assert ks == pytest.approx(halved.k[layer] / E4M3_MAX) and vs == pytest.approx(amax.v[layer] / E4M3_MAX)
        assert float(k.abs().max()) == pytest.approx(E4M3_MAX * ks)  # K beyond the halved amax saturates
        assert torch.equal((k / ks).to(torch.float8_e4m3fn).float() * ks, k)
        assert torch.equal((v / vs).to(torch.float8_e4m3fn).float() * vs, v)
    assert all(0 < s < 0.5 for s in applied.saturation.values())  # only K's top half clipped, V never
    with pytest.raises(PlanError, match="needs calibrated K/V amax"):
        with kv_cache_quantized(model, "FP8"):
            pass


def test_refusals_restore_the_model() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).eval()
    with pytest.raises(PlanError, match="no attention module with k_proj and v_proj"):
        with kv_cache_quantized(gpt2, "FP8_UNSCALED"):
            pass
    model = build_tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(PlanError, match="'flex_attention' attention"):
        with kv_cache_quantized(model, "FP8_E5M2"):
            pass
    model.config._attn_implementation = "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with kv_cache_quantized(model, "FP8_E5M2"):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, kvcache._STATE_ATTR) for m in model.modules())
    assert not any(m.k_proj._forward_hooks for m in attention_modules(model).values())


def test_attention_that_bypasses_the_interface_is_refused(monkeypatch) -> None:
    """A model whose attention never calls the interface would be scored unquantized: refused instead."""
    model = build_tiny_model("llama")
    attn = model.model.layers[1].self_attn
    monkeypatch.setattr(attn, "forward", lambda hidden_states, *a, **kw: (attn.o_proj(attn.v_proj(hidden_states)
                                                                                      .repeat(1, 1, 2)), None))
    with pytest.raises(PlanError, match=r"1 layer\(s\) \('model.layers.1.self_attn'\)"):
        with torch.no_grad(), kv_cache_quantized(model, "FP8_E5M2"):
            attn.k_proj(torch.zeros(1, 1, attn.k_proj.in_features))  # its k_proj runs, the interface never does
            model(_ids())


def test_scores_see_the_kv_cache_and_its_saturation() -> None:
    model = build_tiny_model("llama")
    ids = _ids()
    ref = compute_reference(model, ids, batch_size=2, model_sha="x", eval_key="y")
    none = score_plan(model, {}, ids, ref)
    assert none.kl_mean == 0 and none.kv_cache == "AUTO" and none.kv_saturation == {}
    amax = calibrate_kv_cache(model, {}, _ids(7))
    fp8 = score_plan(model, {}, ids, ref, kv_cache="FP8", inputs=PlanInputs(kv_amax=amax))
    assert fp8.kl_mean > 0 and fp8.kv_cache == "FP8" and set(fp8.kv_saturation) == set(amax.k)
    # K projections scaled far beyond E4M3's range: scale 1.0 clips, and the report says so
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(2000.0)
    ref = compute_reference(model, ids, batch_size=2, model_sha="x", eval_key="y")
    clipped = score_plan(model, {}, ids, ref, kv_cache="FP8_UNSCALED")
    assert max(clipped.kv_saturation.values()) > 0.01
    assert any("FP8_UNSCALED KV cache clipped K or V" in n and "calibrated K/V scales" in n for n in clipped.notes)
    calibrated = score_plan(model, {}, ids, ref, kv_cache="FP8",
                            inputs=PlanInputs(kv_amax=calibrate_kv_cache(model, {}, ids)))
    assert max(calibrated.kv_saturation.values()) == 0 and calibrated.kl_mean < clipped.kl_mean


def test_clipping_warning_names_the_layers_an_unscaled_cache_overflows() -> None:
    from quantcore.evaluation.kvcache import kv_clipping

    amax = {"k": {"model.layers.0.self_attn": 20.0, "model.layers.1.self_attn": 912.5},
            "v": {"model.layers.0.self_attn": 3.0, "model.layers.1.self_attn": 4.0}}
    msg = kv_clipping(amax, "FP8_UNSCALED")
    assert msg is not None and "reach 912.5 in 1 of 2 attention layer(s) ('model.layers.1.self_attn')" in msg
    assert "448" in msg and "choose FP8" in msg
    for fmt in ("FP8", "AUTO", "FP8_E5M2"):  # calibrated scales, nothing cached in FP8, or ±57344 of range
        assert kv_clipping(amax, fmt) is None
    assert kv_clipping({"k": {"a": 1e5}, "v": {}}, "FP8_E5M2") is not None
    assert kv_clipping(None, "FP8_UNSCALED") is None
    assert kv_clipping({"k": {"a": 447.0}, "v": {"a": 448.0}}, "FP8_UNSCALED") is None  # 448 itself is held
    # FP8 attention quantizes Q at scale 1.0 whatever the K/V scales: a Q beyond 448 is named for both FP8_ATTN
    # formats, never for a cache-only one
    big_q = {"k": {"a": 20.0}, "v": {"a": 3.0}, "q": {"a": 600.0}}
    assert kv_clipping(big_q, "FP8_UNSCALED") is None and kv_clipping(big_q, "FP8") is None
    for fmt in ("FP8_ATTN", "FP8_ATTN_UNSCALED"):
        msg = kv_clipping(big_q, fmt)
        assert msg is not None and ": Q reach 600 in 1 of 1" in msg and "does not clip Q" in msg
    assert "K or Q reach 912.5" in kv_clipping({**amax, "q": {"model.layers.0.self_attn": 500.0}}, "FP8_ATTN_UNSCALED")
    assert kv_clipping(amax, "FP8_ATTN") is None  # calibrated K/V, and no Q recorded (an older calibration)


def test_sliding_window_layers_cache_only_their_window() -> None:
    from quantcore.evaluation.kvcache import kv_bytes_per_sequence, kv_layer_elements

    lin = _linears(6, 256)  # 512 elements a token in each of 6 layers
    assert kv_layer_elements(lin) == {f"model.layers.{b}.self_attn": 512 for b in range(6)}
    full = kv_bytes_per_sequence(lin, "AUTO", 32768)
    assert full == 6 * 512 * 2 * 32768 == kv_bytes_per_token(lin, "AUTO") * 32768
    # Gemma 3's pattern: five sliding layers of 1,024 tokens to one global layer
    windows = {f"model.layers.{b}.self_attn": 1024 for b in range(5)}
    assert kv_bytes_per_sequence(lin, "AUTO", 32768, windows=windows) == 512 * 2 * (5 * 1024 + 32768)
    assert kv_bytes_per_sequence(lin, "FP8", 500, windows=windows) == 6 * 512 * 500  # shorter than the window
    assert kv_bytes_per_sequence(_linears(2, 8, fused=True), "AUTO", 10) is None


def test_intake_records_which_layers_attend_to_a_window() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from quantcore.models.summary import attention_windows

    gemma = build_tiny_model("gemma3")  # layer_types: sliding (window 8), full
    assert attention_windows(gemma) == {"model.layers.0.self_attn": 8}
    small = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    with torch.device("meta"):
        mistral = MistralForCausalLM(MistralConfig(**small, sliding_window=4096, max_position_embeddings=32768))
        unbounded = MistralForCausalLM(MistralConfig(**small, sliding_window=4096, max_position_embeddings=4096))
        llama = LlamaForCausalLM(LlamaConfig(**small))
    assert attention_windows(mistral) == dict.fromkeys(
        ("model.layers.0.self_attn", "model.layers.1.self_attn"), 4096)
    assert attention_windows(unbounded) == {}  # a window as long as any context is none
    assert attention_windows(llama) == {}


# ---------------------------------------------------------------------- FP8 attention


def _identity_attention(model, *, round_probs: bool):
    """Every attention of ``model`` through :func:`kvcache.fp8_attention_forward`, with Q, K and V untouched."""
    from functools import partial

    modules = attention_modules(model)
    state = kvcache._LayerState(lambda q, k, v: (q, k, v),
                                partial(kvcache.fp8_attention_forward, round_probs=round_probs))
    return kvcache._attention_wrapped(model, modules, dict.fromkeys(modules, state), "test")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fp8_attention_without_rounding_is_the_models_own_attention(arch: str) -> None:
    """Masks (causal, padding, Gemma 3's sliding window), scaling and the GQA repeat are the model's own: with no
    rounding at all the FP8 attention path gives the model's logits; rounding P alone changes them."""
    model = build_tiny_model(arch)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded second sequence
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        with _identity_attention(model, round_probs=False):
            same = model(ids, attention_mask=mask).logits
        with _identity_attention(model, round_probs=True):
            rounded = model(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sdpa"
    keep = mask.bool()  # padded positions attend to nothing real; their logits are not compared
    torch.testing.assert_close(same[keep], ref[keep], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rounded[keep], ref[keep], atol=1e-5)


def test_fp8_attention_rounds_the_probabilities_in_flash_attentions_range() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    module = torch.nn.Module()
    out, _ = kvcache.fp8_attention_forward(module, q, k, v, None, scaling=0.5)
    s = q @ k.transpose(2, 3) * 0.5
    p = torch.exp(s - s.amax(-1, keepdim=True)) * 256  # FlashAttention 3: P in [0, 256]
    expected = (p.to(torch.float8_e4m3fn).float() @ v) / p.sum(-1, keepdim=True)  # row sum before rounding
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-6, rtol=1e-6)
    exact = torch.softmax(s, -1) @ v
    assert 1e-4 < float((out - exact.transpose(1, 2)).abs().max()) < 0.1
    with pytest.raises(PlanError, match="'softcap'.*score this model with FP8 or FP8_UNSCALED"):
        kvcache.fp8_attention_forward(module, q, k, v, None, softcap=30.0)


def test_the_backend_note_says_where_the_attention_assumption_and_the_gpu_part_ways() -> None:
    from quantcore.evaluation.kvcache import attention_backend_note

    hopper = attention_backend_note("FP8_UNSCALED", 90, "NVIDIA H100")
    assert hopper is not None and "FlashAttention 3" in hopper and "Score FP8_ATTN_UNSCALED" in hopper
    assert attention_backend_note("FP8", 90, "NVIDIA H100").endswith(
        "Score FP8_ATTN to see what FlashAttention 3 costs.")
    blackwell = attention_backend_note("FP8_ATTN", 100, "NVIDIA B200")
    assert blackwell is not None and "Hopper (sm90) only" in blackwell and "scored by FP8." in blackwell
    for sm, gpu in ((100, "NVIDIA B200"), (89, "NVIDIA L40S")):
        per_head = attention_backend_note("FP8_ATTN_HEAD", sm, gpu)
        assert per_head is not None and "per-head K/V scales are read only by vLLM's FlashAttention" in per_head
        assert f"on the {gpu} (sm{sm})" in per_head and per_head.endswith("score FP8 (attention in BF16) for this GPU.")
    for fmt, sm in (("FP8_ATTN", 90), ("FP8_ATTN_HEAD", 90), ("FP8", 80), ("FP8", 100), ("FP8_E5M2", 90),
                    ("AUTO", 90)):
        assert attention_backend_note(fmt, sm, "gpu") is None  # they agree, or nothing is cached in E4M3


@pytest.fixture
def attention_spy(monkeypatch):
    """Record the Q, K and V that reach the FP8 attention function."""
    real = kvcache.fp8_attention_forward
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((query.detach().clone(), key.detach().clone(), value.detach().clone()))
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(kvcache, "fp8_attention_forward", recording)
    return seen


def test_fp8_attention_quantizes_q_at_scale_one(attention_spy) -> None:
    """vLLM's FP8 attention runs Q at the checkpoint's q_scale, which llm-compressor's kv_cache_scheme does not
    write (vLLM then uses 1.0): Q is on the unscaled E4M3 grid under both formats, K and V follow their scales."""
    model = build_tiny_model("llama")
    ids = _ids()
    with torch.no_grad(), kv_amax_observed(model) as amax:
        model(ids)
    assert set(amax.q) == set(amax.k) and all(a > 0 for a in amax.q.values())
    for fmt in ("FP8_ATTN_UNSCALED", "FP8_ATTN"):
        attention_spy.clear()
        with torch.no_grad(), kv_cache_quantized(model, fmt, amax=amax) as applied:
            model(ids)
        assert applied.q_scale == dict.fromkeys(amax.q, 1.0)
        assert len(attention_spy) == TINY_LAYERS
        for i, (q, k, _) in enumerate(attention_spy):
            assert torch.equal(q, q.to(torch.float8_e4m3fn).float())
            ks = applied.k_scale[f"model.layers.{i}.self_attn"]
            assert ks == (1.0 if fmt == "FP8_ATTN_UNSCALED" else pytest.approx(amax.k[f"model.layers.{i}.self_attn"]
                                                                               / E4M3_MAX))
            assert torch.equal((k / ks).to(torch.float8_e4m3fn).float() * ks, k)
    # a cache-only format leaves Q alone and never calls the FP8 attention function
    attention_spy.clear()
    with torch.no_grad(), kv_cache_quantized(model, "FP8", amax=amax) as applied:
        model(ids)
    assert attention_spy == [] and applied.q_scale == {}
    assert KvAmax.from_dict({"k": amax.k, "v": amax.v}).q == {}  # a calibration stored before Q was recorded


def test_scores_of_fp8_attention_add_the_error_of_q_and_p() -> None:
    model = build_tiny_model("llama")
    ids = _ids()
    ref = compute_reference(model, ids, batch_size=2, model_sha="x", eval_key="y")
    amax = calibrate_kv_cache(model, {}, _ids(7))
    assert set(amax.q) == set(amax.k)
    cache = score_plan(model, {}, ids, ref, kv_cache="FP8", inputs=PlanInputs(kv_amax=amax))
    attn = score_plan(model, {}, ids, ref, kv_cache="FP8_ATTN", inputs=PlanInputs(kv_amax=amax))
    assert attn.kv_cache == "FP8_ATTN" and set(attn.kv_saturation) == set(amax.k)
    assert attn.kl_mean > cache.kl_mean > 0
    # per-head K/V scales: the calibration recorded every head, and the score differs from one scale per layer
    assert set(amax.k_head) == set(amax.k)
    head = score_plan(model, {}, ids, ref, kv_cache="FP8_ATTN_HEAD", inputs=PlanInputs(kv_amax=amax))
    assert head.kv_cache == "FP8_ATTN_HEAD" and head.kl_mean > 0 and head.kl_mean != attn.kl_mean
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------- layers kept out of the cache format


def test_skip_entries_resolve_to_attention_layers_or_are_refused() -> None:
    from quantcore.evaluation.kvcache import kv_skip_layers, normalize_kv_skip

    assert normalize_kv_skip(["Sliding_Window", 3, "3", " 0 "]) == ["sliding_window", "3", "0"]
    for bad in (["x"], [1.5], [True], [-1]):
        with pytest.raises(PlanError, match="decoder layer indices or 'sliding_window'"):
            normalize_kv_skip(bad)
    layers = [f"model.layers.{b}.self_attn" for b in range(4)]
    windows = {layers[0]: 512, layers[2]: 512}
    assert kv_skip_layers([3, "sliding_window"], layers, windows) == {layers[0], layers[2], layers[3]}
    assert kv_skip_layers([], layers, windows) == set()
    with pytest.raises(PlanError, match=r"KV cache skip 7: the model's attention layers are 0\.\.3"):
        kv_skip_layers([7], layers, windows)
    with pytest.raises(PlanError, match="no sliding-window attention layer"):
        kv_skip_layers(["sliding_window"], layers, {})


def test_skipped_layers_cost_the_model_dtype_in_memory() -> None:
    from quantcore.evaluation.kvcache import kv_bytes_per_sequence

    lin = _linears(4, 256)  # 512 elements a token in each layer
    skip = {"model.layers.0.self_attn"}
    assert kv_bytes_per_token(lin, "FP8", skip=skip) == 3 * 512 + 512 * 2
    assert kv_bytes_per_token(lin, "AUTO", skip=skip) == kv_bytes_per_token(lin, "AUTO")
    windows = {"model.layers.0.self_attn": 100}
    assert kv_bytes_per_sequence(lin, "FP8", 1000, windows=windows, skip=skip) == 3 * 512 * 1000 + 512 * 2 * 100


def test_plan_files_carry_the_layers_kept_out_of_the_cache() -> None:
    from quantcore.planning.plans import kv_label

    spec = PlanSpec.from_yaml("default: FP8_DYNAMIC\nkv_cache: FP8\nkv_cache_skip: [sliding_window, 0]\n")
    assert spec.kv_cache_skip == ["sliding_window", "0"] and spec.to_dict()["kv_cache_skip"] == ["sliding_window", 0]
    assert PlanSpec.from_yaml(spec.to_yaml()) == spec
    assert kv_label(spec) == "FP8 except sliding_window, 0" == kv_label(spec.to_dict())
    assert kv_label({"kv_cache": "FP8"}) == "FP8" and kv_label({}) == "AUTO"
    assert "kv_cache_skip" not in PlanSpec.from_yaml("default: FP8\nkv_cache: FP8\n").to_dict()
    with pytest.raises(PlanError, match="'kv_cache_skip' keeps layers out of a quantized KV cache, but 'kv_cache' is"):
        PlanSpec.from_yaml("default: FP8\nkv_cache_skip: [0]\n")
    with pytest.raises(PlanError, match="'kv_cache_skip': KV cache layers to skip must be"):
        PlanSpec.from_yaml("default: FP8\nkv_cache: FP8\nkv_cache_skip: [first]\n")


def test_skipped_layers_keep_their_k_and_v_and_their_attention(spy) -> None:
    """Gemma 3's sliding-window layer kept out: its K and V reach attention untouched, the full layer's are
    rounded, and only the quantized layer is counted for saturation."""
    from quantcore.evaluation.kvcache import kv_skip_layers
    from quantcore.models.summary import attention_windows

    model = build_tiny_model("gemma3")
    ids = _ids()
    with torch.no_grad():
        model(ids)
        plain = list(spy)
        spy.clear()
        skip = kv_skip_layers(["sliding_window"], attention_modules(model), attention_windows(model))
        assert skip == {"model.layers.0.self_attn"}
        with kv_cache_quantized(model, "FP8_UNSCALED", skip=skip) as applied:
            model(ids)
    (k0, v0), (k1, _) = spy
    assert torch.equal(k0, plain[0][0]) and torch.equal(v0, plain[0][1])  # layer 0: the model's own values
    assert torch.equal(k1, k1.to(torch.float8_e4m3fn).float()) and not torch.equal(k1, plain[1][0])
    assert set(applied.saturation) == {"model.layers.1.self_attn"}
    with pytest.raises(PlanError, match="is not an attention module"):
        with kv_cache_quantized(model, "FP8_UNSCALED", skip={"model.layers.9.self_attn"}):
            pass


def test_scores_with_skipped_layers_sit_between_none_and_all() -> None:
    model = build_tiny_model("gemma3")
    ids = _ids()
    ref = compute_reference(model, ids, batch_size=2, model_sha="x", eval_key="y")
    every = score_plan(model, {}, ids, ref, kv_cache="FP8_E5M2")
    kept = score_plan(model, {}, ids, ref, kv_cache="FP8_E5M2", kv_skip=["sliding_window"])
    both = score_plan(model, {}, ids, ref, kv_cache="FP8_E5M2", kv_skip=["sliding_window", 1])
    assert every.kl_mean > kept.kl_mean > 0 and both.kl_mean == 0
    assert set(kept.kv_saturation) == {"model.layers.1.self_attn"} and both.kv_saturation == {}
    with pytest.raises(PlanError, match="KV cache skip 5"):
        score_plan(model, {}, ids, ref, kv_cache="FP8_E5M2", kv_skip=[5])


def test_fp8_attention_in_chunks_of_query_rows_is_the_same(monkeypatch) -> None:
    """A long context is computed a few query rows at a time (bounded memory): the same numbers, with an additive
    or a boolean mask."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 8, generator=gen)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen) for _ in range(2))
    causal = torch.full((9, 9), float("-inf")).triu(1).expand(2, 1, 9, 9)
    module = torch.nn.Module()
    whole, _ = kvcache.fp8_attention_forward(module, q, k, v, causal, scaling=0.3)
    monkeypatch.setattr(kvcache, "FP8_ATTENTION_CHUNK_ELEMENTS", 2 * 4 * 9 * 2)  # two query rows a chunk
    chunked, _ = kvcache.fp8_attention_forward(module, q, k, v, causal, scaling=0.3)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)  # the GEMMs' blocking may differ by an ulp
    boolean, _ = kvcache.fp8_attention_forward(module, q, k, v, causal == 0, scaling=0.3)
    assert torch.equal(boolean, chunked)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["FP8", "FP8_E5M2", "FP8_ATTN", "FP8_ATTN_UNSCALED", "FP8_ATTN_HEAD"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_kv_cache_matches_cpu(arch: str, fmt: str) -> None:
    """The KV cache emulation (and FP8 attention, with Gemma 3's sliding windows) gives the same logits on CUDA as
    on the CPU, with the CPU's calibrated K/V maxima, and the same scales."""
    cpu = build_tiny_model(arch)
    gpu = build_tiny_model(arch).cuda()
    ids = _ids()
    with torch.no_grad(), kv_amax_observed(cpu) as amax:
        cpu(ids)
    with torch.no_grad(), kv_cache_quantized(cpu, fmt, amax=amax) as on_cpu, \
            kv_cache_quantized(gpu, fmt, amax=amax) as on_gpu:
        expected = cpu(ids).logits
        got = gpu(ids.cuda()).logits.cpu()
    assert on_gpu.k_scale == on_cpu.k_scale and on_gpu.q_scale == on_cpu.q_scale
    with torch.no_grad():
        assert not torch.allclose(cpu(ids).logits, expected, atol=1e-4)  # the format changed the logits
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_per_head_scales_give_each_kv_head_its_own_range(attention_spy) -> None:
    """FP8_ATTN_HEAD: each KV head of K and V on the E4M3 grid of its own scale (its calibrated max / 448), as
    llm-compressor's attn_head strategy stores them; the per-layer maximum is the largest head's."""
    model = build_tiny_model("llama")
    ids = _ids()
    with torch.no_grad(), kv_amax_observed(model) as amax:
        model(ids)
    for layer, heads in amax.k_head.items():
        assert len(heads) == TINY_KV_HEADS == len(amax.v_head[layer])
        assert max(heads) == amax.k[layer] and max(amax.v_head[layer]) == amax.v[layer]
    assert KvAmax.from_dict(amax.to_dict()) == amax
    with torch.no_grad(), kv_cache_quantized(model, "FP8_ATTN_HEAD", amax=amax) as applied:
        model(ids)
    assert len(attention_spy) == TINY_LAYERS and applied.q_scale == dict.fromkeys(amax.q, 1.0)
    for i, (q, k, v) in enumerate(attention_spy):
        layer = f"model.layers.{i}.self_attn"
        assert torch.equal(q, q.to(torch.float8_e4m3fn).float())  # Q at scale 1.0, as FP8_ATTN
        for x, scales, maxima in ((k, applied.k_scale[layer], amax.k_head[layer]),
                                  (v, applied.v_scale[layer], amax.v_head[layer])):
            assert scales == pytest.approx([a / E4M3_MAX for a in maxima])
            for h, s in enumerate(scales):
                assert torch.equal((x[:, h] / s).to(torch.float8_e4m3fn).float() * s, x[:, h])
    # the smaller head has a finer grid than one scale per layer would give it
    assert len({tuple(s) for s in applied.k_scale.values()}) == TINY_LAYERS
    assert any(min(s) < max(s) for s in applied.k_scale.values())


def test_per_head_scales_need_a_calibration_that_recorded_the_heads() -> None:
    model = build_tiny_model("llama")
    with torch.no_grad(), kv_amax_observed(model) as amax:
        model(_ids())
    old = KvAmax.from_dict({"k": amax.k, "v": amax.v, "q": amax.q})  # stored before the heads were recorded
    assert old.k_head == {} and old.v_head == {}
    with pytest.raises(PlanError, match="FP8_ATTN_HEAD needs per-head K/V maxima for 2 attention layer.*calibrate "
                                        "again"):
        with kv_cache_quantized(model, "FP8_ATTN_HEAD", amax=old):
            pass
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad(), kv_cache_quantized(model, "FP8_ATTN", amax=old):  # per-layer scales still work
        model(_ids())


def test_head_spread_ranks_the_layers_whose_heads_differ_most() -> None:
    from quantcore.evaluation.kvcache import kv_head_spread

    amax = {"k_head": {"a": [8.0, 2.0], "b": [1.0, 1.0]}, "v_head": {"a": [3.0, 1.0], "c": [0.0, 1.0]}}
    assert kv_head_spread(amax) == [("a", "K", 4.0), ("a", "V", 3.0), ("b", "K", 1.0)]  # an all-zero head: no ratio
    assert kv_head_spread({"k": {"a": 1.0}}) == [] == kv_head_spread(None)


def test_kv_calibration_and_score_round_each_gptq_layer_once(monkeypatch) -> None:
    """A GPTQ plan scored with a calibrated KV cache: the calibration and the score share one gptq_cache, so GPTQ
    runs once per layer (the score job's own order), and the score is the one without the cache, bit for bit."""
    import quantcore.algorithms.gptq as gptq_mod  # the module whose GPTQ rounding handler calls gptq_quantize
    from quantcore.algorithms.gptq import collect_hessians

    model = build_tiny_model("llama")
    ids = _ids(4)
    plan = {n: "W4A16_GPTQ" for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    hessians = collect_hessians(model, list(plan), ids)
    ref = compute_reference(model, ids, batch_size=2, model_sha="x", eval_key="y")
    calls: list[int] = []
    real = gptq_mod.gptq_quantize
    monkeypatch.setattr(gptq_mod, "gptq_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))

    def score(cache):
        amax = calibrate_kv_cache(model, plan, ids, inputs=PlanInputs(weight_hessians=hessians, gptq_cache=cache))
        return score_plan(model, plan, ids, ref, kv_cache="FP8",
                          inputs=PlanInputs(kv_amax=amax, weight_hessians=hessians, gptq_cache=cache))

    plain = score(None)
    assert len(calls) == 2 * len(plan)  # rounded for the calibration, and again for the score
    calls.clear()
    shared = score({})
    assert len(calls) == len(plan)
    assert shared.kl_mean == plain.kl_mean and shared.top1_agree == plain.top1_agree
