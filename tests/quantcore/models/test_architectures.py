"""The architecture registry (quantcore.models.architectures): which norm feeds which projections, the linear before
o_proj / down_proj, MoE naming, looked up by a config's model_type."""

from __future__ import annotations

import pytest

from quantcore.models.architectures import (
    GEMMA2,
    LLAMA,
    LLAMA_STYLE,
    MLP_NORM_GEMMA,
    MLP_NORM_LLAMA,
    Architecture,
    architecture_of,
    get_architecture,
    list_architectures,
    register_architecture,
)
from tests.factories import tiny_moe

B = "model.layers.3"


def test_model_types_find_their_architecture_and_unknown_ones_the_llama_style_default():
    assert get_architecture("llama") is LLAMA and get_architecture("qwen2") is LLAMA
    assert get_architecture("gemma3_text") is GEMMA2 and get_architecture("gemma2") is GEMMA2
    assert get_architecture("some_new_model") is LLAMA_STYLE and get_architecture(None) is LLAMA_STYLE
    assert list_architectures()["mistral"] == "llama"


def test_a_model_type_cannot_be_registered_as_two_architectures():
    with pytest.raises(ValueError, match="already registered as llama"):
        register_architecture("llama")(Architecture("other"))


def test_the_norm_before_the_mlp_is_gemmas_pre_feedforward_norm_where_a_block_has_one():
    assert GEMMA2.mlp_norm_of(B) == f"{B}.{MLP_NORM_GEMMA}"
    assert LLAMA.mlp_norm_of(B, {f"{B}.{MLP_NORM_GEMMA}"}) == f"{B}.{MLP_NORM_LLAMA}"
    # an architecture nobody registered looks for Gemma's norm first, as quantcore always did
    assert LLAMA_STYLE.mlp_norm_of(B, {f"{B}.{MLP_NORM_GEMMA}"}) == f"{B}.{MLP_NORM_GEMMA}"
    assert LLAMA_STYLE.mlp_norm_of(B, set()) == f"{B}.{MLP_NORM_LLAMA}"


def test_each_linear_name_has_its_role_in_the_block():
    arch = LLAMA_STYLE
    assert arch.attention_input_block(f"{B}.self_attn.k_proj") == B
    assert arch.mlp_input_block(f"{B}.mlp.up_proj") == B
    assert arch.mlp_input_block(f"{B}.mlp.experts.2.up_proj") is None
    assert arch.expert_input_block(f"{B}.mlp.experts.2.gate_proj") == B
    assert arch.attention_output_block(f"{B}.self_attn.o_proj") == B
    assert arch.mlp_output(f"{B}.mlp.down_proj") == (B, f"{B}.mlp")
    assert arch.mlp_output(f"{B}.mlp.experts.2.down_proj") == (B, f"{B}.mlp.experts.2")
    assert arch.attention_input_block("lm_head") is None and arch.mlp_output("lm_head") is None


def test_the_previous_linear_of_o_proj_and_down_proj_is_v_proj_and_up_proj():
    assert LLAMA_STYLE.previous_linear == {"o_proj": "v_proj", "down_proj": "up_proj"}
    assert LLAMA_STYLE.rows_divided_by(f"{B}.self_attn.v_proj") == f"{B}.self_attn.o_proj"
    assert LLAMA_STYLE.rows_divided_by(f"{B}.mlp.up_proj") == f"{B}.mlp.down_proj"
    assert LLAMA_STYLE.rows_divided_by(f"{B}.mlp.gate_proj") is None


def test_tensor_parallelism_splits_the_registry_s_column_and_row_leaves():
    assert LLAMA_STYLE.column_leaves == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert LLAMA_STYLE.row_leaves == ("o_proj", "down_proj")


def test_folds_reach_the_norm_fed_linears_and_those_after_a_linear_and_the_kv_cache_reads_k_and_v():
    assert set(LLAMA_STYLE.fold_leaves) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj"}
    assert LLAMA_STYLE.kv_proj == ("k_proj", "v_proj")


def test_a_split_moe_model_names_its_experts_as_the_registry_does():
    from quantcore.models.moe import split_experts

    model = tiny_moe()
    split_experts(model)
    arch = architecture_of(model)
    names = {n for n, _ in model.named_modules()}
    block = "model.layers.0"
    assert arch.router_of(block) in names and arch.experts_of(block) in names
    assert {arch.expert_linear(block, 0, leaf) for leaf in (*arch.gate_up, arch.down_proj)} <= names


def test_gemma_1_names_its_mlp_norm_as_llama_does_and_gemma_2_and_3_their_pre_feedforward_norm():
    from quantcore.models.architectures import MLP_NORM_GEMMA, MLP_NORM_LLAMA, get_architecture

    # Gemma 1's blocks have input_layernorm / post_attention_layernorm only (an export naming
    # pre_feedforward_layernorm for it would point at a module that does not exist)
    assert get_architecture("gemma").mlp_norm == MLP_NORM_LLAMA == "post_attention_layernorm"
    assert get_architecture("gemma2").mlp_norm == get_architecture("gemma3_text").mlp_norm == MLP_NORM_GEMMA
