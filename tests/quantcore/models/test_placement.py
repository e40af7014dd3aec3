"""A model over several GPUs (quantcore.models.placement): accelerate's placement of a meta-device model, which
decoder block goes to which device for given memory, decided on the CPU; and the load itself on CUDA (``gpu``)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from quantcore.models.placement import PlacementError, empty_model, model_bytes, placement_for, plan_placement
from tests.factories import save_tiny_llama

HAS_CUDA = torch.cuda.is_available()


def _config(layers: int = 6) -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _sizes(config) -> tuple[int, int]:
    """(the model's float32 bytes, one decoder block's), from the meta-device model."""
    model = empty_model(config)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was allocated
    return model_bytes(model, torch.float32), model_bytes(model.model.layers[0], torch.float32)


def test_a_model_too_big_for_one_device_is_split_between_blocks_in_order():
    config = _config()
    total, block = _sizes(config)
    placed = plan_placement(config, {0: total // 2, 1: total}, dtype=torch.float32)
    on = placed.blocks_on()
    assert placed.split and list(on) == [0, 1]
    assert on[0] + on[1] == list(range(6)) and on[0] and on[1]  # every block whole, device 0's first
    assert placed.device_of("model.embed_tokens") == 0 and placed.device_of("lm_head") == 1
    assert placed.device_of("model.layers.1.self_attn.q_proj") == placed.device_of("model.layers.1.mlp.down_proj")
    held0 = model_bytes(empty_model(config).model.embed_tokens, torch.float32) + len(on[0]) * block
    assert held0 <= total // 2  # device 0 holds no more than it was given
    assert placed.model_bytes == total


def test_more_memory_on_the_first_device_moves_blocks_onto_it():
    config = _config()
    total, block = _sizes(config)
    fewer = plan_placement(config, {0: total // 2, 1: total}, dtype=torch.float32).blocks_on()[0]
    more = plan_placement(config, {0: total // 2 + 2 * block, 1: total}, dtype=torch.float32).blocks_on()[0]
    assert len(more) == len(fewer) + 2


def test_a_model_that_fits_the_first_device_stays_whole_there():
    config = _config()
    total, _ = _sizes(config)
    placed = plan_placement(config, {0: 2 * total, 1: 2 * total}, dtype=torch.float32)
    assert not placed.split and placed.blocks_on() == {0: list(range(6))}


def test_a_model_too_big_for_every_device_together_is_refused_with_its_size():
    config = _config()
    total, _ = _sizes(config)
    with pytest.raises(PlacementError, match=r"llama model of 0\.0\d GiB in torch.float32 does not fit across the "
                                             r"devices \(device 0: 0\.00 GiB, device 1: 0\.00 GiB\)"):
        plan_placement(config, {0: total // 4, 1: total // 4}, dtype=torch.float32)
    with pytest.raises(PlacementError, match="max_memory is empty"):
        plan_placement(config, {}, dtype=torch.float32)


def test_a_job_places_over_its_gpus_only_when_its_one_device_is_too_small(tmp_path):
    folder = save_tiny_llama(tmp_path / "tiny")
    from quantcore.models.loading import load_config

    need = model_bytes(empty_model(load_config(folder)), torch.float32)
    assert placement_for(folder, "cpu", budget={0: 1, 1: 1}) is None  # a CPU job: one device
    assert placement_for(folder, "cuda", dtype=torch.float32, budget={0: need}) is None  # one GPU
    assert placement_for(folder, "cuda", dtype=torch.float32, budget={0: 2 * need, 1: 2 * need}) is None  # fits
    placed = placement_for(folder, "cuda", dtype=torch.float32, budget={0: need * 98 // 100, 1: 2 * need})
    assert placed is not None and placed.split and placed.blocks_on() == {0: [0], 1: [1]}
    # a job on cuda:1 spreads over the GPUs from its own on
    assert placement_for(folder, "cuda:1", dtype=torch.float32, budget={0: 9 * need, 1: need // 2}) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_a_device_map_load_on_cuda_gives_the_one_device_logits(tmp_path):
    """On one GPU the device_map path (every weight loaded straight onto its device) against `.to("cuda")`."""
    from quantcore.models.loading import load_model

    folder = save_tiny_llama(tmp_path / "tiny")
    ids = torch.randint(3, 100, (2, 16))
    whole, _ = load_model(folder, device="cuda", dtype=torch.float32)
    mapped, _ = load_model(folder, device="cuda", dtype=torch.float32, device_map={"": 0})
    with torch.no_grad():
        a = whole(ids.cuda(), use_cache=False).logits
        b = mapped(ids.cuda(), use_cache=False).logits
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (this machine has "
                    f"{torch.cuda.device_count()})")
def test_a_model_split_over_two_gpus_gives_the_one_gpu_logits(tmp_path):
    from quantcore.models.loading import load_config, load_model

    folder = save_tiny_llama(tmp_path / "tiny")
    need = model_bytes(empty_model(load_config(folder)), torch.float32)
    placed = placement_for(folder, "cuda", dtype=torch.float32, budget={0: need * 98 // 100, 1: 2 * need})
    assert placed is not None and placed.devices == [0, 1]
    ids = torch.randint(3, 100, (2, 16))
    whole, _ = load_model(folder, device="cuda", dtype=torch.float32)
    split, _ = load_model(folder, device="cuda", dtype=torch.float32, device_map=placed.device_map)
    assert {p.device.index for p in split.parameters()} == {0, 1}
    with torch.no_grad():
        a = whole(ids.cuda(), use_cache=False).logits
        b = split(ids.cuda(), use_cache=False).logits.to(a.device)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # the same arithmetic; only the device differs
