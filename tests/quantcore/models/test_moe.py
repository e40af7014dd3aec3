"""Mixture-of-experts models: experts split into linears (quantcore.models.moe), plans over them, routed step costs
(quantcore.models.routing). Tiny Qwen3-MoE / Mixtral / gpt-oss built from configs; no download."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantcore.algorithms.gptq import collect_hessians
from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import PlanError
from quantcore.evaluation.calibrate import calibrate
from quantcore.models.moe import LinearExperts, all_experts, split_experts, unsplit_experts
from quantcore.models.routing import Routing, bench_ms, routed_layers, step_share
from quantcore.planning.plans import PlanSpec, group_label, resolve_plan
from quantcore.schemes.fusion import expert_block, fusion_units, plan_unit_of
from tests.factories import MOE_ARCHS, WORDS, save_tiny_moe, tiny_moe

VOCAB = len(WORDS) + 3
MOE_BLOCKS = {"deepseek_v3": ["model.layers.1.mlp.experts"]}  # the others: both blocks


def ids(n: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


# ----------------------------------------------------------------------------- splitting


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_split_experts_keeps_the_logits_and_names_one_linear_per_expert(arch):
    model = tiny_moe(arch)
    x = ids()
    with torch.no_grad():
        before = model(x).logits
    params = sum(p.numel() for p in model.parameters())
    dense = linear_names(model)  # transformers 5 keeps the routed experts in 3-D tensors: none of these
    assert not any(".experts." in n for n in dense)

    blocks = split_experts(model)
    assert blocks == MOE_BLOCKS.get(arch, ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"])
    assert unsplit_experts(model) == []
    with torch.no_grad():
        after = model(x).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)  # gate and up as two GEMMs instead of one
    assert sum(p.numel() for p in model.parameters()) == params
    names = linear_names(model)
    # llm-compressor's linearize_moe names them so: an exported recipe's regexes reach the same layers
    assert [n for n in names if ".experts.1." in n and "layers.1" in n] == [
        "model.layers.1.mlp.experts.1.gate_proj", "model.layers.1.mlp.experts.1.up_proj",
        "model.layers.1.mlp.experts.1.down_proj"]
    assert len(names) == len(dense) + len(blocks) * 4 * 3
    fused = tiny_moe(arch).model.layers[1].mlp.experts
    expert = model.model.layers[1].mlp.experts[2]
    inter = expert.up_proj.out_features
    assert torch.equal(expert.gate_proj.weight, fused.gate_up_proj[2, :inter])
    assert torch.equal(expert.up_proj.weight, fused.gate_up_proj[2, inter:])
    assert torch.equal(expert.down_proj.weight, fused.down_proj[2])


def test_experts_of_another_layout_stay_fused_and_are_named():
    model = tiny_moe("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    assert split_experts(model) == []  # interleaved gate/up with biases and a clamp: not transformers' default
    assert unsplit_experts(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_intake_lists_every_expert_linear_and_the_routing(tmp_path):
    from quantcore.models.loading import load_model
    from quantcore.models.summary import inspect_folder

    folder = save_tiny_moe(tmp_path / "moe")
    summary = inspect_folder(folder)
    assert summary.moe == {"experts": 4, "top_k": 2,
                           "blocks": ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]}
    assert summary.unsplit_experts == []
    names = [lin.name for lin in summary.linears]
    assert len(names) == 33 and "model.layers.1.mlp.experts.3.down_proj" in names
    down = next(lin for lin in summary.linears if lin.name == "model.layers.1.mlp.experts.3.down_proj")
    assert (down.out_features, down.in_features) == (64, 32)
    model, _ = load_model(folder)
    assert linear_names(model) == names  # the loaded model has the linears intake listed, in that order
    assert isinstance(model.model.layers[0].mlp.experts, LinearExperts)


# ----------------------------------------------------------------------------- calibration sees every expert


def dead_expert_model() -> nn.Module:
    """16 experts, one per token: a few tokens leave most experts without any."""
    model = tiny_moe(num_experts=16, num_experts_per_tok=1)
    split_experts(model)
    return model


def test_calibration_runs_every_expert_on_every_token_as_llm_compressor_does():
    model = dead_expert_model()
    x = ids(1, 4)
    seen: dict[str, int] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.__setitem__(n, seen.get(n, 0) + a[0].shape[0]))
             for n, m in model.named_modules() if isinstance(m, nn.Linear) and expert_block(n)]
    with torch.no_grad():
        routed_logits = model(x).logits
    routed_seen = dict(seen)
    seen.clear()
    with torch.no_grad(), all_experts():
        all_logits = model(x).logits
    for h in hooks:
        h.remove()
    experts = [n for n in linear_names(model) if expert_block(n)]
    assert len(routed_seen) < len(experts)  # routed: 4 tokens reach at most 4 of the 16 experts of a block
    assert sum(routed_seen.values()) == 2 * 4 * 3  # each token: one expert's three linears, in both blocks
    assert seen == {n: 4 for n in experts}  # every expert linear saw all 4 tokens
    torch.testing.assert_close(all_logits, routed_logits, rtol=0, atol=1e-6)  # only routed outputs are kept

    stats = calibrate(model, x)
    assert all(stats[n].amax > 0 for n in experts)  # a static scale for every expert, none resting on nothing
    # so the gate/up of every expert of a block read one input: the Outliers page shows each block's once
    from quantcore.evaluation.outliers import shared_expert_inputs

    kept, stands_for = shared_expert_inputs(stats)
    per_block = 2 * len([n for n in experts if n.startswith("model.layers.0.") and n.endswith("down_proj")])
    assert stands_for == {f"model.layers.{b}.mlp.experts.0.gate_proj": per_block for b in (0, 1)}
    assert len(kept) == len(stats) - 2 * (per_block - 1)
    assert {st.name for st in kept} >= {n for n in experts if n.endswith("down_proj")}  # each down_proj its own


def test_gptq_hessians_cover_experts_no_token_was_routed_to():
    model = dead_expert_model()
    names = [n for n in linear_names(model) if expert_block(n)]
    hessians = collect_hessians(model, names, ids(1, 4))
    assert set(names) <= set(hessians)
    assert all(float(hessians[n].diagonal().sum()) > 0 for n in names)


# ----------------------------------------------------------------------------- plans


NAMES = (["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj"]
         + [f"m.layers.0.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
         + ["m.layers.0.mlp.shared_expert.gate_proj", "m.layers.0.mlp.shared_expert.up_proj", "lm_head"])


def test_the_experts_of_a_block_are_one_unit_of_a_plan():
    units = fusion_units(NAMES)
    experts = [n for n in NAMES if ".experts." in n]
    assert units == [NAMES[:3], experts, NAMES[-3:-1], ["lm_head"]]
    assert plan_unit_of("m.layers.0.mlp.experts.1.down_proj", NAMES) == experts
    assert plan_unit_of("m.layers.0.mlp.shared_expert.up_proj", NAMES) == NAMES[-3:-1]
    assert group_label(experts) == "m.layers.0.mlp.experts.* (9 expert linears)"


def test_a_plan_that_splits_a_blocks_experts_across_schemes_is_refused():
    spec = PlanSpec.from_dict({"default": "FP8_DYNAMIC", "rules": [{"match": "down_proj", "scheme": "BF16"}]})
    with pytest.raises(PlanError, match=r"experts of m\.layers\.0\.mlp\.experts mix schemes \(BF16, FP8_DYNAMIC\)"):
        resolve_plan(spec, NAMES)
    spec = PlanSpec.from_dict({"default": "FP8_DYNAMIC", "rules": [{"match": r"experts\.", "scheme": "W4A16"}]})
    resolved = resolve_plan(spec, NAMES)
    assert {resolved[n].name for n in NAMES if ".experts." in n} == {"W4A16"}


# ----------------------------------------------------------------------------- routed step costs


def test_routing_counts_an_experts_share_of_a_step():
    r = Routing(experts=8, top_k=2)
    assert r.touched(1) == pytest.approx(0.25) and r.tokens(1) == pytest.approx(1.0) and r.expert_m(1) == 1
    assert r.touched(16) == pytest.approx(1 - 0.75 ** 16)
    assert r.tokens(16) * r.touched(16) == pytest.approx(16 * 2 / 8)  # the expected tokens of one expert
    assert r.expert_m(2048) == 512
    assert bench_ms([1, 16, 2048], {"a": r}) == [1, 5, 16, 512, 2048]
    assert bench_ms([1, 16], {}) == [1, 16]
    with pytest.raises(ValueError, match="top_k"):
        Routing(experts=4, top_k=5)
    routed = routed_layers(NAMES, {"experts": 3, "top_k": 1, "blocks": ["m.layers.0.mlp.experts"]})
    assert set(routed) == {n for n in NAMES if ".experts." in n}
    assert routed_layers(NAMES, None) == {} and routed_layers(NAMES, {"experts": 3, "top_k": None}) == {}

    times = {(1, 8, 4, "baseline"): 2.0, (512, 8, 4, "baseline"): 10.0}
    assert step_share(times, 1, 8, 4, "baseline", None) == 2.0
    assert step_share(times, 1, 8, 4, "baseline", r) == pytest.approx(0.25 * 2.0)
    assert step_share(times, 2048, 8, 4, "baseline", r) == pytest.approx(10.0 * r.touched(2048))
    assert step_share(times, 16, 8, 4, "baseline", r) is None  # M = 5 was not measured


def test_the_roofline_bound_of_an_expert_is_its_share_of_the_step():
    from quantcore.kernels.roofline import layer_bound, step_bound

    r = Routing(experts=8, top_k=2)
    dense_1, dense_4096 = (layer_bound("BF16", 4096, 4096, "h100", m) for m in (1, 4096))
    routed_1, routed_4096 = (layer_bound("BF16", 4096, 4096, "h100", m, r) for m in (1, 4096))
    assert routed_1.memory_ms == pytest.approx(dense_1.memory_ms * 0.25)  # two of eight experts read at decode
    assert routed_1.compute_ms == pytest.approx(dense_1.compute_ms * 0.25)
    assert routed_4096.memory_ms == pytest.approx(dense_4096.memory_ms)  # a long prefill reads every expert
    assert routed_4096.compute_ms == pytest.approx(dense_4096.compute_ms * 0.25)  # on a quarter of the tokens
    shapes = {n: (64, 64) for n in NAMES}
    plan = {n: "BF16" for n in NAMES}
    routed = routed_layers(NAMES, {"experts": 3, "top_k": 1})
    dense, moe = step_bound(plan, shapes, "h100", 1), step_bound(plan, shapes, "h100", 1, routed)
    assert moe.memory_ms == pytest.approx(dense.memory_ms * (6 + 9 / 3) / 15)  # 6 dense layers, 9 experts at 1/3


def test_the_step_estimate_times_an_expert_at_its_own_m():
    from quantcore.kernels.estimate import step_estimate
    from quantcore.kernels.records import KernelRecord

    def rec(m, ms):
        return KernelRecord(device="cpu", device_name="cpu", torch_version="x", m=m, n=64, k=64, path="baseline",
                            ms=ms, tflops=None, pct_peak=None, speedup=1.0, native=True, max_rel_err=0.0,
                            padded_m=None, skipped=None)

    expert = "m.layers.0.mlp.experts.0.up_proj"
    shapes = {"dense": (64, 64), expert: (64, 64)}
    r = Routing(experts=4, top_k=2)
    assert r.expert_m(8) == 5  # 8 tokens x 2 / 4 experts, over the 99.6 % chance an expert is touched at all
    est = step_estimate([rec(1, 1.0), rec(8, 4.0)], shapes, {}, m_prefill=8, m_decode=1, routed={expert: r})
    assert est["decode_ms"] == pytest.approx(1.0 + 0.5 * 1.0)  # half the experts touched, one token each
    assert est["missing_prefill"] == [expert]  # its M = 5 was not timed: left out, never guessed
    est = step_estimate([rec(1, 1.0), rec(5, 3.0), rec(8, 4.0)], shapes, {}, m_prefill=8, m_decode=1,
                        routed={expert: r})
    assert est["prefill_ms"] == pytest.approx(4.0 + 3.0 * r.touched(8))
    assert est["per_layer"][expert]["prefill_ms"] == pytest.approx(3.0 * r.touched(8))


def test_a_static_input_scale_is_one_per_block_as_vllms_fused_moe_reads_it():
    """vLLM keeps one static input scale for a block's expert gate/up and one for its down_proj, the largest of the
    experts' ("Using the maximum across experts for each layer"): the emulation does the same."""
    from quantcore.algorithms.apply import apply_plan
    from quantcore.formats.scales import scale_from_amax

    model = dead_expert_model()
    stats = calibrate(model, ids(1, 8))
    amax = {n: s.amax for n, s in stats.items()}
    names = linear_names(model)
    # FP8: static per-tensor input scales
    applied = apply_plan(model, {n: "FP8" for n in names}, PlanInputs(act_amax=amax))
    try:
        scales = {n: applied._states[n].static_scale for n in names}
    finally:
        applied.restore()
    for block in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        down = [n for n in names if n.startswith(block) and n.endswith("down_proj")]
        own = {n: float(scale_from_amax(amax[n], "fp8_e4m3")) for n in down}
        assert len(set(own.values())) > 1  # each expert's down_proj saw its own input
        assert {scales[n] for n in down} == {max(own.values())}
        gate_up = [n for n in names if n.startswith(block) and not n.endswith("down_proj")]
        assert len({scales[n] for n in gate_up}) == 1  # every expert saw every token: one input, one scale
    q = "model.layers.0.self_attn.q_proj"
    assert scales[q] == pytest.approx(float(scale_from_amax(amax[q], "fp8_e4m3")))  # a dense layer keeps its own
    # NVFP4's fused MoE keeps every expert's own input tensor scale (vLLM's w2_input_global_scale per expert)
    applied = apply_plan(model, {n: "NVFP4" for n in names}, PlanInputs(act_amax=amax))
    try:
        scales = {n: applied._states[n].static_scale for n in names}
    finally:
        applied.restore()
    down = [n for n in names if ".experts." in n and n.endswith("down_proj")]
    assert {n: scales[n] for n in down} == pytest.approx({n: float(scale_from_amax(amax[n], "nvfp4")) for n in down})


def block_by_hand(block: LinearExperts, args: tuple, *, per_block: bool, shards: int = 1) -> torch.Tensor:
    """An MoE block's routed forward written out with FP8 per-tensor dynamic activation scales: from the whole
    block's input and all routed experts' down_proj inputs together (``per_block``), or each expert's own; with
    ``shards`` > 1 each of that many shares of the down_proj input (K) on its own scale, as each GPU's fused MoE
    quantizes its share under tensor parallelism."""
    import torch.nn.functional as F

    from quantcore.formats.quantize import fake_quantize
    from quantcore.formats.scales import scale_from_amax

    def q(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        return fake_quantize(t, "fp8_e4m3", "tensor", scale=scale_from_amax(amax, "fp8_e4m3"))

    def amaxes(h: torch.Tensor) -> torch.Tensor:
        return torch.stack([part.abs().amax() for part in h.tensor_split(shards, dim=-1)])

    x, index, weights = args
    mask = F.one_hot(index, num_classes=block.num_experts + 1).permute(2, 1, 0)
    hidden = []
    for e in range(block.num_experts):
        pos, tok = torch.where(mask[e])
        if len(tok):
            xe, expert = x[tok], block[e]
            xq = q(xe, x.abs().amax() if per_block else xe.abs().amax())
            hidden.append((e, pos, tok, expert.act_fn(F.linear(xq, expert.gate_proj.weight))
                           * F.linear(xq, expert.up_proj.weight)))
    amax2 = torch.stack([amaxes(h) for *_, h in hidden]).amax(dim=0)
    out = torch.zeros_like(x)
    for e, pos, tok, h in hidden:
        own = amax2 if per_block else amaxes(h)
        hq = torch.cat([q(part, own[i]) for i, part in enumerate(h.tensor_split(shards, dim=-1))], dim=-1)
        y = F.linear(hq, block[e].down_proj.weight)
        out.index_add_(0, tok, y * weights[tok, pos, None])
    return out


def test_a_dynamic_per_tensor_scale_covers_the_whole_block_as_in_vllms_fused_moe():
    """vLLM's fused MoE quantizes the block's input once (one dynamic scale for every expert's gate/up) and all routed
    experts' down_proj inputs together (one more): FP8_PER_TENSOR experts are emulated so, not one scale per
    expert's own tokens. Checked against the block's forward written out by hand; per-token schemes are untouched."""
    from quantcore.algorithms.apply import quantized_model

    model = tiny_moe()
    split_experts(model)
    block_name = "model.layers.0.mlp.experts"
    block = model.get_submodule(block_name)
    plan = {n: "FP8_PER_TENSOR" for n in linear_names(model) if expert_block(n)}
    seen = {}
    handle = block.register_forward_hook(lambda _m, args, out: seen.update(args=args, out=out.detach()))

    with torch.no_grad(), quantized_model(model, plan):
        model(ids())
        torch.testing.assert_close(seen["out"], block_by_hand(block, seen["args"], per_block=True), rtol=1e-5,
                                   atol=1e-6)
        assert not torch.allclose(seen["out"], block_by_hand(block, seen["args"], per_block=False), rtol=1e-5,
                                  atol=1e-6)  # it matters
    assert block.block_amax is None  # restored: the plain routed forward again
    with torch.no_grad(), quantized_model(model, {n: "FP8_DYNAMIC" for n in plan}):
        model(ids())
        assert block.block_amax is None  # per-token scales: nothing block-wide to emulate
    handle.remove()


def test_at_tensor_parallel_each_gpu_quantizes_its_share_of_the_experts_down_proj_input():
    """Split over 2 GPUs (each expert's down_proj cut along K), each GPU's fused MoE takes the block-wide dynamic
    scale of its own share of the down_proj inputs; with expert parallelism every expert is whole on one GPU and the
    block takes one scale again. The gate/up input (the block's input, whole on every GPU) keeps one scale."""
    from quantcore.algorithms.apply import quantized_model
    from quantcore.models.parallel import Parallelism

    model = tiny_moe()
    split_experts(model)
    block = model.get_submodule("model.layers.0.mlp.experts")
    plan = {n: "FP8_PER_TENSOR" for n in linear_names(model) if expert_block(n)}
    seen = {}
    handle = block.register_forward_hook(lambda _m, args, out: seen.update(args=args, out=out.detach()))
    with torch.no_grad():
        with quantized_model(model, plan, PlanInputs(parallel=Parallelism(2))):  # (by hand with the quantized weights)
            model(ids())
            torch.testing.assert_close(seen["out"], block_by_hand(block, seen["args"], per_block=True, shards=2),
                                       rtol=1e-5, atol=1e-6)
            assert not torch.allclose(seen["out"], block_by_hand(block, seen["args"], per_block=True), rtol=1e-5,
                                      atol=1e-6)
        assert block.w2_shards == 1  # restored
        with quantized_model(model, plan, PlanInputs(parallel=Parallelism(2, expert_parallel=True))):
            model(ids())
            torch.testing.assert_close(seen["out"], block_by_hand(block, seen["args"], per_block=True), rtol=1e-5,
                                       atol=1e-6)
    handle.remove()


def test_schemes_vllms_fused_moe_cannot_serve_on_experts_are_named():
    from quantcore.planning.serving import moe_unserved

    def plan(experts: str, rest: str = "INT8_PER_TENSOR") -> dict[str, str]:
        return {n: experts if ".experts." in n else rest for n in NAMES}

    for ok in ("FP8_DYNAMIC", "FP8", "FP8_BLOCK", "W4A16", "W8A16_GPTQ", "NVFP4", "NVFP4A16", "MXFP4",
               "INT8_W8A8", "BF16"):
        assert moe_unserved(plan(ok)) == [], ok  # INT8 per tensor elsewhere is a dense layer's business
    for bad in ("INT8_PER_TENSOR", "INT8_PER_TENSOR_SQ", "MXFP8"):
        (msg,) = moe_unserved(plan(bad))
        assert f"no kernel for {bad} experts ('m.layers.0.mlp.experts')" in msg and "Unsupported FusedMoe" in msg


def test_smoothquant_folds_an_experts_down_proj_into_its_own_up_proj_and_exports_it_so():
    """An expert's down_proj reads act(gate) * up of that expert only: its factors fold exactly into that
    expert's up_proj rows. Its gate/up read the norm that also feeds the router, so they are left unsmoothed,
    and the recipe's SmoothQuant mappings must not name them (llm-compressor would smooth what was scored
    unsmoothed, and the router would read a rescaled input)."""
    import yaml

    from quantcore.algorithms.smoothquant import smooth_model
    from quantcore.export.llmcompressor import to_llmcompressor_recipe

    model = tiny_moe()
    split_experts(model)
    stats = calibrate(model, ids())
    names = linear_names(model)
    x = ids(1, 12, seed=5)
    with torch.no_grad():
        before = model(x).logits
    down, up = "model.layers.1.mlp.experts.2.down_proj", "model.layers.1.mlp.experts.2.up_proj"
    gate = "model.layers.1.mlp.experts.2.gate_proj"
    handle = smooth_model(model, {n: torch.as_tensor(stats[n].channel_max) for n in (down, gate)}, 0.5)
    try:
        assert handle.folded_into == {down: up} and "router" in handle.skipped[gate]
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, before, rtol=0, atol=1e-5)  # an exact fold
    finally:
        handle.restore()

    attn = [f"model.layers.{b}.self_attn.{p}_proj" for b in range(2) for p in "qkvo"]
    dense = [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    experts = [f"model.layers.1.mlp.experts.{e}.{p}_proj" for e in range(4) for p in ("gate", "up", "down")]
    names = attn + dense + experts + ["lm_head"]
    plan = {n: "BF16" if n == "lm_head" else "INT8_W8A8" if n.endswith("o_proj") else "INT8_W8A8_SQ" for n in names}
    recipe = yaml.safe_load(to_llmcompressor_recipe(plan, layer_names=names))
    mappings = recipe["quant_stage"]["smoothing_modifiers"]["SmoothQuantModifier"]["mappings"]
    assert [["re:.*down_proj"], "re:.*up_proj"] in mappings  # every down_proj, each into its own up_proj
    gate_up = [balance for balance, _ in mappings if any("gate_proj" in p for p in balance)]
    assert gate_up == [["re:model\\.layers\\.0\\.mlp\\.gate_proj$", "re:model\\.layers\\.0\\.mlp\\.up_proj$"]]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16", "NVFP4"])
def test_cuda_split_experts_match_the_cpu(scheme):
    """On a GPU (``pytest -m gpu``): the split experts compute what the fused ones do, calibration reaches every
    expert, and a plan over the experts quantizes them as on the CPU."""
    from quantcore.algorithms.apply import quantized_model

    cpu, gpu = tiny_moe(), tiny_moe().cuda()
    x = ids()
    with torch.no_grad():
        fused = gpu(x.cuda()).logits.cpu()
    for model in (cpu, gpu):
        split_experts(model)
    with torch.no_grad():
        torch.testing.assert_close(gpu(x.cuda()).logits.cpu(), fused, rtol=0, atol=1e-4)
    stats = calibrate(gpu, x.cuda())
    experts = [n for n in linear_names(gpu) if expert_block(n)]
    assert all(stats[n].amax > 0 for n in experts)
    plan = {n: scheme for n in experts}
    amax = {n: stats[n].amax for n in experts}  # NVFP4's calibrated activation tensor scale (the others ignore it)
    calibrated = PlanInputs(act_amax=amax)
    with quantized_model(cpu, plan, calibrated), quantized_model(gpu, plan, calibrated), torch.no_grad():
        for name in experts:
            assert torch.equal(cpu.get_submodule(name).weight, gpu.get_submodule(name).weight.cpu()), name
        torch.testing.assert_close(gpu(x.cuda()).logits.cpu(), cpu(x).logits, rtol=0, atol=1e-3)


def test_awq_folds_an_experts_gate_up_into_the_norm_with_the_router_and_every_expert_of_the_block():
    """AWQ's factors for a routed expert's gate/up fold into the norm before the MoE block: every expert's gate/up
    and the router's weight columns take s, so the routing and the logits are unchanged (SmoothQuant leaves them,
    see above)."""
    from quantcore.algorithms.smoothquant import fold_factors

    model = dead_expert_model()
    x = ids(1, 12, seed=3)
    with torch.no_grad():
        before = model(x).logits
    router = model.model.layers[1].mlp.gate.weight.detach().clone()
    s = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.5
    handle = fold_factors(model, {"model.layers.1.mlp.experts.3.gate_proj": s})
    try:
        assert not handle.skipped
        scaled = set(handle.factors)
        assert scaled == {f"model.layers.1.mlp.experts.{e}.{p}" for e in range(16) for p in ("gate_proj", "up_proj")}
        assert set(handle.folded_into.values()) == {"model.layers.1.post_attention_layernorm"}
        torch.testing.assert_close(model.model.layers[1].mlp.gate.weight, (router.double() * s.double()).float())
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, before, rtol=0, atol=1e-5)
    finally:
        handle.restore()
    assert torch.equal(model.model.layers[1].mlp.gate.weight, router)
