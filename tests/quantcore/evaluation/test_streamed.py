"""Block-streamed execution (quantcore.models.streaming, quantcore.evaluation.streamed) against the whole model.

Tiny checkpoints saved with save_pretrained (tests.factories) are loaded whole by transformers and streamed block by
block from their safetensors files; on a CPU every result must be bit-identical (same batches, same arithmetic order).
SmolLM2 (the demo model) repeats the comparison in a slow test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import CheckpointError, PlanError
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import score_plan
from quantcore.evaluation.streamed import calibrate_streamed, reference_streamed, score_streamed
from quantcore.models.loading import load_model
from quantcore.models.streaming import StreamedModel, choose_stream
from tests.factories import TINY_VOCAB, build_tiny_model, tiny_tokenizer

BATCH = 2


def save(folder: Path, arch: str, **kw) -> Path:
    build_tiny_model(arch).save_pretrained(folder, **kw)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def eval_ids(n: int = 5, length: int = 16, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def assert_same_stats(a, b) -> None:
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.n_tokens == y.n_tokens, name
        np.testing.assert_array_equal(x.channel_max, y.channel_max, err_msg=name)
        np.testing.assert_array_equal(x.weight_channel_max, y.weight_channel_max, err_msg=name)
        np.testing.assert_array_equal(x.hist_counts, y.hist_counts, err_msg=name)
        assert x.token_max == y.token_max, name
        assert x.zeros == y.zeros, name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_streamed_calibration_and_reference_are_bit_identical(tmp_path, arch):
    folder = save(tmp_path / arch, arch)
    whole, _ = load_model(folder)
    ids = eval_ids()
    streamed = StreamedModel(folder)
    messages: list[str] = []
    assert_same_stats(calibrate(whole, ids, batch_size=BATCH),
                      calibrate_streamed(streamed, ids, batch_size=BATCH, progress=lambda f, m: messages.append(m)))
    assert "streamed, block 2/2" in messages
    assert all(p.device.type == "meta" for b in streamed.stack.blocks for p in b.parameters())  # every block freed
    ref = compute_reference(whole, ids, batch_size=BATCH)
    got = reference_streamed(streamed, ids, batch_size=BATCH)
    for name in ("nll", "argmax", "top1_logprob", "logprobs", "lognorm"):
        assert torch.equal(getattr(ref, name), getattr(got, name)), name


@pytest.mark.parametrize(("arch", "scheme", "kv"), [("llama", "INT8_PER_TENSOR", "FP8"), ("gemma3", "W4A16", None),
                                                    ("qwen2", "INT8_W8A8_SQ", None)])
def test_streamed_score_equals_whole(tmp_path, arch, scheme, kv):
    """A plan with static activation scales (and a calibrated FP8 KV cache), a weight-only plan and SmoothQuant:
    every number of the report is the same streamed and whole, and the identity plan is exactly KL 0."""
    from quantcore.evaluation.kvcache import kv_amax_observed

    folder = save(tmp_path / arch, arch)
    whole, _ = load_model(folder)
    ids = eval_ids()
    stats = calibrate(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in stats.values()},
                        act_channel_max={s.name: s.channel_max for s in stats.values()})
    if kv:
        with kv_amax_observed(whole) as amax:
            calibrate(whole, ids, batch_size=BATCH)
        inputs = inputs.replace(kv_amax=amax)
    plan = {name: scheme for name in stats}
    ref = compute_reference(whole, ids, batch_size=BATCH)
    expected = score_plan(whole, plan, ids, ref, inputs=inputs, kv_cache=kv).to_dict()
    streamed = StreamedModel(folder)
    got = score_streamed(streamed, plan, ids, ref, inputs=inputs, kv_cache=kv).to_dict()
    assert got.pop("notes") == expected.pop("notes") or scheme.endswith("_SQ")  # SQ notes may group differently
    assert got == expected
    assert expected["kl_mean"] > 0
    identity = score_streamed(streamed, {}, ids, ref)
    assert identity.kl_mean == 0.0 and identity.top1_agree == 1.0


def test_streamed_kv_cache_calibration_equals_whole(tmp_path):
    """The K/V maxima a calibrated KV cache format needs, with a static-scale plan applied block by block."""
    from quantcore.evaluation.scoring import calibrate_kv_cache
    from quantcore.evaluation.streamed import calibrate_kv_cache_streamed

    folder = save(tmp_path / "m", "gemma3")
    whole, _ = load_model(folder)
    ids = eval_ids()
    stats = calibrate(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in stats.values()})
    plan = dict.fromkeys(stats, "INT8_PER_TENSOR")
    expected = calibrate_kv_cache(whole, plan, ids, inputs=inputs, batch_size=BATCH).to_dict()
    got = calibrate_kv_cache_streamed(StreamedModel(folder), plan, ids, inputs=inputs, batch_size=BATCH).to_dict()
    assert got == expected and expected["k"]


def test_hidden_states_in_a_scratch_file_are_removed(tmp_path):
    """A budget that leaves no room for the hidden states puts them in a memory-mapped file in the scratch folder;
    the results are the same and the folder is empty afterwards, also after an error."""
    folder = save(tmp_path / "m", "llama")
    ids = eval_ids()
    free = StreamedModel(folder)
    scratch = tmp_path / "scratch"
    tight = StreamedModel(folder, budget=free.resident_bytes() + free.block_bytes(0) + 1024, scratch=scratch)
    n, length = ids.shape
    assert tight.state_plan(n, length).where == "file"
    seen: list[list[Path]] = []
    tight_states = tight.run(ids, batch_size=BATCH, block_context=lambda i: _listing(scratch, seen))
    assert seen and all(any(p.suffix == ".bin" for p in files) for files in seen)
    assert torch.equal(tight_states, free.run(ids, batch_size=BATCH))
    assert list(scratch.iterdir()) == []

    def boom(i):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        tight.run(ids, batch_size=BATCH, block_context=boom)
    assert list(scratch.iterdir()) == []


class _listing:
    def __init__(self, folder: Path, seen: list) -> None:
        self.folder, self.seen = folder, seen

    def __enter__(self):
        self.seen.append([p for d in self.folder.iterdir() for p in d.iterdir()])

    def __exit__(self, *exc):
        return False


def test_a_block_larger_than_the_budget_is_refused_with_its_size(tmp_path):
    folder = save(tmp_path / "m", "llama")
    probe = StreamedModel(folder)
    with pytest.raises(PlanError, match=r"block 0 \(model\.layers\.0\) needs .* GiB .* budget of") as err:
        StreamedModel(folder, budget=probe.resident_bytes() + probe.block_bytes(0) - 1)
    assert f"{probe.block_bytes(0) / 2**30:.3g} GiB" in str(err.value)


def test_a_missing_or_truncated_shard_fails_at_the_block_that_reads_it(tmp_path):
    folder = save(tmp_path / "m", "llama", max_shard_size="60KB")
    ids = eval_ids()
    probe = StreamedModel(folder)
    others = {probe.reader.files[n] for n in probe.resident_tensors() + probe.block_tensors(0)}
    shard = next(probe.reader.files[n] for n in probe.block_tensors(1) if probe.reader.files[n] not in others)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    blocks: list[str] = []
    with pytest.raises(CheckpointError, match=rf"block 1 \(model\.layers\.1\): cannot read .* from {shard.name}"):
        calibrate_streamed(StreamedModel(folder), ids, batch_size=BATCH, progress=lambda f, m: blocks.append(m))
    assert "streamed, block 1/2" in blocks and "streamed, block 2/2" not in blocks
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"block 1 \(model\.layers\.1\): weight file {shard.name} is missing"):
        StreamedModel(folder).run(ids, batch_size=BATCH)


def test_a_layout_without_the_parameter_names_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save(tmp_path / "m", "llama")
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("model.layers.", "model.blocks."): v for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"18 are not in the safetensors files of m "
                       r"\('model\.layers\.0\.self_attn\.q_proj\.weight'.*looked in 'model\.safetensors'.*--no-stream"):
        StreamedModel(folder)


def test_choose_stream():
    assert choose_stream(None, 100, 1000) is False
    assert choose_stream(None, 900, 1000) is True  # the weights must leave a quarter for the rest
    assert choose_stream(True, 1, 1000) is True and choose_stream(False, 10**6, 1) is False


@pytest.mark.slow
def test_smollm2_streamed_equals_whole():
    """SmolLM2-135M (the demo model, its GGUF converted to safetensors as registration stores it): calibration
    statistics and a score's KL, top-1 and perplexity streamed and whole, bit-identical on a CPU."""
    from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
    from quantcore.models.validation import default_cache_dir

    demo_model_dir = converted_gguf_folder(demo_gguf_path(), cache_dir=default_cache_dir())
    whole, _ = load_model(demo_model_dir)
    ids = torch.randint(0, 49152, (3, 32), generator=torch.Generator().manual_seed(0))  # two batches
    streamed = StreamedModel(demo_model_dir)
    stats = calibrate(whole, ids, batch_size=BATCH)
    assert_same_stats(stats, calibrate_streamed(streamed, ids, batch_size=BATCH))
    ref = compute_reference(whole, ids, batch_size=BATCH, topk=64)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in stats.values()})
    plan = {name: "INT8_PER_TENSOR" for name in stats}
    expected = score_plan(whole, plan, ids, ref, inputs=inputs).to_dict()
    got = score_streamed(streamed, plan, ids, ref, inputs=inputs).to_dict()
    assert got == expected
