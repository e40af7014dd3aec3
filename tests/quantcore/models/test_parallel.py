"""Tensor parallelism: how vLLM splits each layer over the GPUs, and the serving checks on each GPU's shard."""

from __future__ import annotations

import pytest

from quantcore.errors import PlanError
from quantcore.models.parallel import (
    AttentionHeads,
    Parallelism,
    attention_heads,
    kv_copies,
    parse_tp,
    partition,
    tp_misfits,
)
from quantcore.planning.plans import PlanSpec
from quantcore.planning.serving import fp8_block_misfits, group_misfits, marlin_misfits, regroup_fixes, w4afp8_misfits


def llama_block(p: str, hidden: int, heads: AttentionHeads, intermediate: int) -> dict[str, tuple[int, int]]:
    """(N, K) of one Llama-style decoder layer's linears."""
    q, kv = heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim
    return {f"{p}.self_attn.q_proj": (q, hidden), f"{p}.self_attn.k_proj": (kv, hidden),
            f"{p}.self_attn.v_proj": (kv, hidden), f"{p}.self_attn.o_proj": (hidden, q),
            f"{p}.mlp.gate_proj": (intermediate, hidden), f"{p}.mlp.up_proj": (intermediate, hidden),
            f"{p}.mlp.down_proj": (hidden, intermediate)}


P = "model.layers.0"
QWEN72 = AttentionHeads(64, 8, 128)  # Qwen2.5-72B: hidden 8192, intermediate 29,568 (= 231 x 128)
QWEN72_SHAPES = {**llama_block(P, 8192, QWEN72, 29568), "lm_head": (152064, 8192)}
SMOL = AttentionHeads(9, 3, 64)  # SmolLM2-135M: hidden 576, intermediate 1536


def test_attention_heads_come_from_the_config_with_its_defaults():
    assert attention_heads({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}) == SMOL
    # no num_key_value_heads: multi-head attention; an explicit head_dim wins over hidden / heads (Gemma)
    assert attention_heads({"num_attention_heads": 8, "hidden_size": 512}) == AttentionHeads(8, 8, 64)
    assert attention_heads({"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                            "hidden_size": 640}) == AttentionHeads(8, 4, 256)
    # a multimodal config's text part
    assert attention_heads({"text_config": {"num_attention_heads": 9, "num_key_value_heads": 3,
                                            "hidden_size": 576}}) == SMOL
    assert attention_heads({"hidden_size": 576}) is None
    assert AttentionHeads.from_dict(SMOL.to_dict()) == SMOL and AttentionHeads.from_dict(None) is None


def test_layers_split_as_vllm_splits_them():
    assert [partition(f"{P}.self_attn.{x}") for x in ("q_proj", "k_proj", "v_proj", "o_proj")] == \
        ["column", "column", "column", "row"]
    assert [partition(f"{P}.mlp.{x}") for x in ("gate_proj", "up_proj", "down_proj", "gate")] == \
        ["column", "column", "row", "replicated"]
    assert partition(f"{P}.mlp.experts.3.down_proj") == "row" and partition("lm_head") == "vocab"
    assert partition("transformer.h.0.attn.c_attn") == "unknown"
    shards = Parallelism(8, QWEN72).shards(QWEN72_SHAPES)
    assert shards[f"{P}.self_attn.q_proj"] == (1024, 8192)  # 8 of the 64 heads
    assert shards[f"{P}.self_attn.k_proj"] == (128, 8192)  # one of the 8 key-value heads
    assert shards[f"{P}.self_attn.o_proj"] == (8192, 1024)
    assert shards[f"{P}.mlp.down_proj"] == (8192, 3696)
    assert shards["lm_head"] == (152064 // 8, 8192)  # 152,064 is already a multiple of 64
    # more GPUs than key-value heads: each GPU holds one head, copied
    assert Parallelism(16, QWEN72).shards(QWEN72_SHAPES)[f"{P}.self_attn.v_proj"] == (128, 8192)
    assert Parallelism(1, QWEN72).shards(QWEN72_SHAPES) == QWEN72_SHAPES


def test_what_vllm_refuses_at_a_tensor_parallel_size_before_quantizing():
    smol = llama_block(P, 576, SMOL, 1536)
    [msg] = tp_misfits(smol, Parallelism(2, SMOL))
    assert "9 attention heads" in msg and "Total number of attention heads (9) must be divisible by tensor parallel " \
        "size (2)" in msg
    assert tp_misfits(smol, Parallelism(3, SMOL)) == [] and tp_misfits(smol, Parallelism(1, SMOL)) == []
    # nine GPUs: the heads split and each GPU holds a copy of one of the 3 key-value heads, but 1,536 does not split
    column, row = tp_misfits(smol, Parallelism(9, SMOL))
    assert column.startswith("tensor_parallel 9: 2 column-parallel layer(s) split along N, which 9 does not divide "
                             f"(N = 1536, e.g. {P}.mlp.gate_proj)")
    assert row.startswith("tensor_parallel 9: 1 row-parallel layer(s) split along K, which 9 does not divide "
                          f"(K = 1536, e.g. {P}.mlp.down_proj)")
    odd = AttentionHeads(12, 4, 64)
    [msg] = tp_misfits(llama_block(P, 768, odd, 3072), Parallelism(6, odd))
    assert "4 key-value heads, which neither divide among 6 GPUs nor copy onto them evenly" in msg


def test_a_group_split_over_two_gpus_is_refused_and_a_smaller_group_offered():
    """Qwen2.5-72B's down_proj reads 29,568 inputs: 231 groups of 128 on one GPU, but 14,784 (115.5 groups) on
    each of two and 3,696 on each of eight. vLLM refuses a group split over two GPUs."""
    plan = dict.fromkeys(QWEN72_SHAPES, "W4A16_GPTQ")
    assert group_misfits(plan, QWEN72_SHAPES) == []
    [msg] = group_misfits(plan, QWEN72_SHAPES, Parallelism(2, QWEN72))
    assert msg.startswith("W4A16_GPTQ at tensor_parallel 2: each GPU holds K / 2 = 14784 inputs of 1 row-parallel "
                          f"layer(s) (e.g. {P}.mlp.down_proj), not a whole number of groups of 128")
    assert msg.endswith("such as W4A16_G64_GPTQ, whose groups of 64 divide them")  # 14,784 = 231 x 64
    [msg] = group_misfits(plan, QWEN72_SHAPES, Parallelism(4, QWEN72))
    assert "K / 4 = 7392" in msg and msg.endswith("such as W4A16_G32_GPTQ, whose groups of 32 divide them")  # 231 x 32
    [msg] = group_misfits(plan, QWEN72_SHAPES, Parallelism(8, QWEN72))  # 3,696 is not a whole number of 32 either
    assert "K / 8 = 3696" in msg and msg.endswith("such as W4A16_CHANNEL_GPTQ, with one scale per output channel, "
                                                  "which any K takes")
    # the per-layer choice that mends it: the fitting preset on exactly the layers whose share misfits
    assert regroup_fixes(plan, QWEN72_SHAPES, Parallelism(8, QWEN72)) == {"W4A16_CHANNEL_GPTQ": [f"{P}.mlp.down_proj"]}
    assert regroup_fixes(plan, QWEN72_SHAPES) == {}
    for tp, fits in ((4, "W4A16_G32_GPTQ"), (8, "W4A16_CHANNEL_GPTQ")):
        fitted = dict.fromkeys(QWEN72_SHAPES, fits)
        assert group_misfits(fitted, QWEN72_SHAPES, Parallelism(tp, QWEN72)) == []
        # its groups fit, but 7,392 and 3,696 inputs are off Marlin's thread tiles (K % 64): padded since vLLM#45295
        [tiles] = marlin_misfits(fitted, QWEN72_SHAPES, Parallelism(tp, QWEN72))
        assert f"{8192} x {29568 // tp}" in tiles
    assert group_misfits(dict.fromkeys(QWEN72_SHAPES, "W4A16_G64_GPTQ"), QWEN72_SHAPES, Parallelism(2, QWEN72)) == []
    # per-channel weights have no groups to split; o_proj's 8,192 / 8 = 1,024 is 8 groups
    assert group_misfits(dict.fromkeys(QWEN72_SHAPES, "W8A16"), QWEN72_SHAPES, Parallelism(8, QWEN72)) == []
    assert group_misfits({f"{P}.self_attn.o_proj": "W4A16"}, QWEN72_SHAPES, Parallelism(8, QWEN72)) == []
    # column-parallel layers keep their K whole: gate/up at K = 8,192 fit at any size
    assert group_misfits({f"{P}.mlp.gate_proj": "W4A16", f"{P}.mlp.up_proj": "W4A16"}, QWEN72_SHAPES,
                         Parallelism(8, QWEN72)) == []


def test_fp8_blocks_on_each_gpu():
    """validate_fp8_block_shape at tensor parallelism: each GPU's K of a row-parallel layer a whole number of 128
    columns, and each GPU's N of every member of a column-parallel layer a whole number of 128 rows."""
    plan = {**dict.fromkeys(QWEN72_SHAPES, "FP8_BLOCK"), "lm_head": "BF16"}
    assert fp8_block_misfits(plan, QWEN72_SHAPES) == []
    rows, msg = fp8_block_misfits(plan, QWEN72_SHAPES, Parallelism(2, QWEN72))
    assert rows.startswith("FP8 blocks of 128 rows do not divide N at tensor_parallel 2, on each GPU of 2 "
                           f"column-parallel layer(s) (q/k/v and gate/up merged) (N = 14784, e.g. {P}.mlp.gate_proj)")
    assert msg.startswith("FP8 blocks of 128 columns do not divide K at tensor_parallel 2, on each GPU of 1 "
                          f"row-parallel layer(s) (K = 14784, e.g. {P}.mlp.down_proj)")
    assert fp8_block_misfits({f"{P}.self_attn.o_proj": "FP8_BLOCK"}, QWEN72_SHAPES, Parallelism(8, QWEN72)) == []
    # gate/up at 29,568 / 16 = 1,848 rows a GPU: every member checked once split, the last one too
    rows = [m for m in fp8_block_misfits(plan, QWEN72_SHAPES, Parallelism(16, QWEN72)) if "rows" in m]
    assert rows and "N at tensor_parallel 16, on each GPU of 2 column-parallel layer(s)" in rows[0]
    assert "N = 1848" in rows[0]


def test_w4afp8_tiles_each_gpus_share_of_the_fused_layer():
    """CUTLASS W4A8 wants N a multiple of 128 for the layer each GPU loads: Qwen2.5-72B's gate/up at 2 x 29,568 / 8
    = 7,392 rows (57.75 x 128) no longer tiles at eight GPUs; q/k/v's 1,024 + 128 + 128 does."""
    plan = {**dict.fromkeys(QWEN72_SHAPES, "W4AFP8"), "lm_head": "BF16"}
    assert w4afp8_misfits(plan, QWEN72_SHAPES) == []
    [msg] = w4afp8_misfits(plan, QWEN72_SHAPES, Parallelism(8, QWEN72))
    assert msg.startswith("W4AFP8 on 1 layer(s) as vLLM loads them (q/k/v and gate/up fused) whose output width N on "
                          "each GPU at tensor_parallel 8 is not a multiple of 128 (N = 7392, e.g. "
                          f"{P}.mlp.{{gate,up}}_proj)")
    assert msg.endswith("or choose a smaller tensor_parallel")


def test_the_tensor_parallel_size_is_part_of_the_plan_file():
    spec = PlanSpec.from_yaml("default: W4A16\ntensor_parallel: 4\n")
    assert spec.tensor_parallel == 4 and spec.to_dict()["tensor_parallel"] == 4
    assert PlanSpec.from_dict(spec.to_dict()) == spec
    assert "tensor_parallel" not in PlanSpec(default="FP8").to_dict()  # 1, the default, is not written
    for bad in ("two", 0, -2, 2.5, True):
        with pytest.raises(PlanError, match="'tensor_parallel': tensor_parallel must be"):
            PlanSpec.from_dict({"default": "FP8", "tensor_parallel": bad})
    assert parse_tp("8") == 8


def test_key_value_heads_copied_onto_more_gpus_cost_cache_memory():
    # 8 heads over 8 GPUs: one each
    assert kv_copies(Parallelism(1, QWEN72)) == kv_copies(Parallelism(8, QWEN72)) == 1.0
    assert kv_copies(Parallelism(16, QWEN72)) == 2.0  # each head cached on two GPUs
    assert kv_copies(Parallelism(9, SMOL)) == 3.0 and kv_copies(Parallelism(4, None)) == 1.0


def qwen3_moe_block(p: str, experts: int = 4) -> dict[str, tuple[int, int]]:
    """A Qwen3-30B-A3B decoder layer (hidden 2048, 32 heads / 4 key-value heads of 128, experts 768 wide), with
    ``experts`` of its 128 routed experts."""
    heads = AttentionHeads(32, 4, 128)
    out = {k: v for k, v in llama_block(p, 2048, heads, 768).items() if ".mlp." not in k}
    for e in range(experts):
        out.update({f"{p}.mlp.experts.{e}.gate_proj": (768, 2048), f"{p}.mlp.experts.{e}.up_proj": (768, 2048),
                    f"{p}.mlp.experts.{e}.down_proj": (2048, 768)})
    out[f"{p}.mlp.gate"] = (128, 2048)
    return out


def test_block_fp8_experts_split_over_gpus_and_expert_parallelism():
    """vLLM's fused MoE wants each GPU's share of an expert's 768 intermediate columns a whole number of 128-blocks:
    384 at 2 GPUs, 192 at 4 (refused: "The output_size of gate's and up's weight = 192 is not divisible by weight
    quantization block_n = 128"). Expert parallelism keeps the experts whole, which fits."""
    shapes = qwen3_moe_block(P)
    heads = AttentionHeads(32, 4, 128)
    plan = {**dict.fromkeys(shapes, "FP8_BLOCK"), f"{P}.mlp.gate": "BF16"}
    assert fp8_block_misfits(plan, shapes) == [] and fp8_block_misfits(plan, shapes, Parallelism(2, heads)) == []
    [msg] = fp8_block_misfits(plan, shapes, Parallelism(4, heads))
    assert msg.startswith("FP8 blocks of 128 do not divide the routed experts' intermediate size at tensor_parallel 4, "
                          f"on each GPU in 1 MoE block(s) (192, e.g. {P}.mlp.experts)")
    assert "The output_size of gate's and up's weight = 192" in msg and "--enable-expert-parallel" in msg
    ep = Parallelism(4, heads, expert_parallel=True)
    assert fp8_block_misfits(plan, shapes, ep) == []
    assert ep.shard(f"{P}.mlp.experts.3.down_proj", 2048, 768) == (2048, 768)  # whole on its GPU
    assert ep.shard(f"{P}.self_attn.o_proj", 2048, 4096) == (2048, 1024)  # attention still split
    assert ep.shard(f"{P}.mlp.gate", 128, 2048) == (128, 2048)  # the router whole on every GPU
    # an expert 64 wide on each GPU is refused even on one: its blocks would straddle gate and up
    narrow = {k: ((64, n[1]) if k.endswith(("gate_proj", "up_proj")) else (n[0], 64) if k.endswith("down_proj")
                  else n) for k, n in shapes.items()}
    assert "intermediate size in 1 MoE block(s) (64" in fp8_block_misfits(plan, narrow)[0]
    # INT4 groups on the experts' down_proj: 192 inputs a GPU at 4 GPUs, 1.5 groups of 128; whole under EP
    w4 = {**dict.fromkeys(shapes, "W4A16"), f"{P}.mlp.gate": "BF16"}
    [msg] = group_misfits(w4, shapes, Parallelism(4, heads))
    assert msg.startswith("W4A16 at tensor_parallel 4: each GPU holds K / 4 = 192 inputs of 4 row-parallel layer(s)")
    assert group_misfits(w4, shapes, ep) == []
    assert tp_misfits(shapes, Parallelism(8, heads)) == []  # 32 heads, 4 kv heads copied, 768 / 8 = 96
    assert tp_misfits(shapes, Parallelism(256, heads, expert_parallel=True))[0].startswith(
        "tensor_parallel 256: the model has 32 attention heads")


def test_expert_parallelism_is_part_of_the_plan_file():
    spec = PlanSpec.from_yaml("default: FP8_BLOCK\ntensor_parallel: 4\nexpert_parallel: true\n")
    assert spec.expert_parallel and spec.to_dict()["expert_parallel"] is True
    assert spec.parallelism(AttentionHeads(32, 4, 128)) == Parallelism(4, AttentionHeads(32, 4, 128), True)
    assert "expert_parallel" not in PlanSpec(default="FP8").to_dict()
    with pytest.raises(PlanError, match="'expert_parallel' must be true or false, got 'yes'"):
        PlanSpec.from_dict({"default": "FP8", "expert_parallel": "yes"})


def test_weight_only_layers_off_marlins_thread_tiles():
    """vLLM's Marlin wants (N, K) on a GPU multiples of (64, 128) or (128, 64): SmolLM2's fused q/k/v (960 x 576)
    and o_proj (576 x 576) are neither, gate/up (3072 x 576) and down_proj (576 x 1536) are. Recent vLLM pads
    them; older releases refuse Marlin there."""
    from quantcore.planning.serving import marlin_misfits, marlin_untiled

    shapes = llama_block(P, 576, SMOL, 1536)
    plan = dict.fromkeys(shapes, "W4A16_G64")
    assert sorted((n, k) for _, n, k in marlin_untiled(plan, shapes)) == [(576, 576), (960, 576)]
    [msg] = marlin_misfits(plan, shapes)
    assert msg.startswith("Marlin tiles: 2 weight-only layer(s) as vLLM loads them (q/k/v and gate/up fused) have an "
                          "N x K that fits neither of its thread tiles") and "vllm-project/vllm#45295" in msg
    # split over 3 GPUs: down_proj's 576 x 512 still fits; gate/up's 1024 x 576 too
    assert sorted((n, k) for _, n, k in marlin_untiled(plan, shapes, Parallelism(3, SMOL))) == [(320, 576),
                                                                                               (576, 192)]
    # activations quantized (Marlin is not their kernel) or layers in BF16: nothing to say
    assert marlin_misfits(dict.fromkeys(shapes, "FP8_DYNAMIC"), shapes) == []
    assert marlin_misfits(dict.fromkeys(shapes, "BF16"), shapes) == []
    assert marlin_untiled(dict.fromkeys(QWEN72_SHAPES, "W4A16_GPTQ"), QWEN72_SHAPES) == []


def test_the_gpus_of_a_plan_for_people():
    from quantcore.planning.plans import gpus_label

    assert gpus_label({"default": "FP8"}) == "1 GPU"
    assert gpus_label({"tensor_parallel": 4, "expert_parallel": True}) == "4 GPUs, experts whole"


def test_under_expert_parallelism_a_gpu_runs_its_range_of_experts():
    """vLLM hands each GPU a contiguous range of experts, the remainder to the first GPUs: of 4 experts over 3 GPUs
    the first holds experts 0 and 1, whole; every dense layer is on every GPU."""
    shapes = qwen3_moe_block(P, experts=4)
    ep = Parallelism(3, AttentionHeads(32, 4, 128), expert_parallel=True)
    held = ep.first_gpu(shapes)
    assert sorted({n.split(".experts.")[1].split(".")[0] for n in held if ".experts." in n}) == ["0", "1"]
    assert all(n in held for n in shapes if ".experts." not in n)
    assert Parallelism(3, AttentionHeads(32, 4, 128)).first_gpu(shapes) == list(shapes)  # experts split, all on each


def test_the_inputs_the_gpus_share_are_the_row_parallel_ones():
    """A row-parallel layer's input is cut among the GPUs (each quantizes its own share); column-parallel layers,
    the router, lm_head, and a routed expert kept whole by expert parallelism read all of it."""
    from quantcore.models.parallel import Parallelism

    split, ep = Parallelism(4), Parallelism(4, expert_parallel=True)
    assert [split.input_shards(f"model.layers.0.{leaf}") for leaf in
            ("self_attn.o_proj", "mlp.down_proj", "self_attn.q_proj", "mlp.gate_proj", "mlp.gate")] == [4, 4, 1, 1, 1]
    assert split.input_shards("lm_head") == 1 and Parallelism(1).input_shards("model.layers.0.mlp.down_proj") == 1
    expert = "model.layers.0.mlp.experts.3.down_proj"
    assert split.input_shards(expert) == 4 and ep.input_shards(expert) == 1
    assert ep.input_shards("model.layers.0.mlp.shared_expert.down_proj") == 4  # not a routed expert: split
