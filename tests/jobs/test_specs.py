"""Job specs: defaults written once, checks with messages for people, the jobs.params JSON both ways, old rows."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jobs.errors import InvalidJob
from jobs.specs import (
    ALPHA,
    BATCH_SIZE,
    BUDGET_S,
    CAL_SAMPLES,
    CAL_SEQ_LEN,
    LIMITS,
    M_VALUE,
    MAX_GPUS,
    SAMPLES,
    SCORED_SEQ_LEN,
    SEQ_LEN,
    SPECS,
    TENSOR_PARALLEL,
    TOKEN_DEFAULTS,
    BenchSpec,
    CalibrateSpec,
    RegisterSpec,
    ScoreSpec,
    SensitivitySpec,
    context_problem,
    read_params,
    spec_class,
)


def test_every_job_kind_has_a_spec_named_by_its_kind():
    assert set(SPECS) == {"register", "calibrate", "score", "sensitivity", "bench"}
    assert all(spec.kind == kind for kind, spec in SPECS.items())


def test_a_calibration_reads_32_sequences_of_256_tokens_on_the_cpu_by_default():
    spec = CalibrateSpec()
    assert (spec.samples, spec.seq_len, spec.device, spec.dataset, spec.batch_size) == (32, 256, "cpu", None, 4)


def test_a_score_reads_16_by_256_tokens_of_each_text_by_default():
    spec = ScoreSpec(scheme="FP8_DYNAMIC")
    assert (spec.samples, spec.seq_len, spec.cal_samples, spec.cal_seq_len) == (16, 256, 16, 256)
    assert TOKEN_DEFAULTS == {"samples": 16, "seq_len": 256, "cal_samples": 16, "cal_seq_len": 256}
    assert SensitivitySpec(scheme="INT8_W8A8").token_params() == ScoreSpec().token_params()


def test_a_benchmark_times_the_default_m_values_for_60_s_per_shape():
    spec = BenchSpec()
    assert (spec.m, spec.ms, spec.budget_s, spec.paths, spec.tensor_parallel) == (None, (1, 16, 128, 2048), 60.0,
                                                                                   None, 1)


def test_the_benchmark_defaults_are_the_kernel_benchmarks_own():
    kernels = pytest.importorskip("quantcore.kernels.bench")
    assert BenchSpec.DEFAULT_MS == kernels.DEFAULT_MS
    assert BenchSpec().budget_s == kernels.DEFAULT_BUDGET_S


@pytest.mark.parametrize(("build", "words"), [
    (lambda: CalibrateSpec(samples=0), ["calibrate job's samples", "between 1 and", "got 0"]),
    (lambda: CalibrateSpec(samples=100_000_000), ["samples", "65,536 sequences", "got 100,000,000"]),
    (lambda: CalibrateSpec(seq_len=10_000_000), ["seq_len", "1,048,576", "got 10,000,000"]),
    (lambda: ScoreSpec(seq_len=1), ["score job's seq_len", "first token is predicted by nothing", "between 2",
                                    "got 1"]),
    (lambda: ScoreSpec(cal_samples="many"), ["cal_samples", "whole number", "'many'"]),
    (lambda: ScoreSpec(tensor_parallel=0), ["tensor_parallel must be between 1 and 1024 GPUs, got 0"]),
    (lambda: SensitivitySpec(), ["sensitivity job", "scheme", "kv_sweep", "neither"]),
    (lambda: SensitivitySpec(scheme="FP8_DYNAMIC", alpha=1.5), ["alpha", "between 0 and 1", "got 1.5"]),
    (lambda: RegisterSpec(), ["register job needs a source", "or demo"]),
    (lambda: BenchSpec(budget_s=0), ["budget_s", "more than 0", "got 0"]),
    (lambda: BenchSpec(m=[1, 0]), ["bench job's m", "between 1", "got 0"]),
    (lambda: BenchSpec(m="1,16"), ["bench job's m", "list of whole numbers", "'1,16'"]),
    (lambda: BenchSpec(device="tpu"), ["bench job's device", "'cpu' or 'cuda'", "'tpu'"]),
    (lambda: BenchSpec(queue=" "), ["queue", "gpu.sm90"]),
])
def test_a_value_out_of_range_is_refused_with_a_sentence_naming_it(build, words):
    with pytest.raises(InvalidJob) as caught:
        build()
    assert isinstance(caught.value, ValueError)  # shown as every ValueError's message is
    for word in words:
        assert word in str(caught.value)


def test_values_the_front_ends_send_are_accepted_and_normalised():
    spec = BenchSpec(device=" cuda:1 ", m=[1, "16"], paths=["int8_row"], tensor_parallel="2", budget_s="20")
    assert (spec.device, spec.m, spec.paths, spec.tensor_parallel, spec.budget_s) == ("cuda:1", (1, 16),
                                                                                      ("int8_row",), 2, 20.0)
    assert BenchSpec(budget_s=0.0005).budget_s == 0.0005  # a tight budget skips cases, as a test asks
    assert RegisterSpec(demo=True, source="/x").demo  # the demo wins over a path, as the worker reads it


def test_a_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CalibrateSpec().samples = 3  # type: ignore[misc]


@pytest.mark.parametrize("spec", [
    RegisterSpec(source="/models/tiny", name="tiny", user="ann"),
    RegisterSpec(demo=True),
    CalibrateSpec(samples=3, seq_len=16, dataset=7, device="cuda"),
    ScoreSpec(scheme="W4A16_GPTQ", cal_dataset="news", kv_cache="FP8", tensor_parallel=2, expert_parallel=True,
              label="mine v2", predicted_kl=0.0),
    ScoreSpec(plan={"default": "FP8_DYNAMIC", "layers": {}}, batch_size=2),
    SensitivitySpec(kv_sweep="FP8", groups=False),
    SensitivitySpec(scheme="INT8_W8A8", alpha=0.0, tensor_parallel=4, queue="gpu"),
    BenchSpec(m=[1, 32], paths=["int8_row+q", "w8_row"], force=True, tensor_parallel=2, expert_parallel=True),
])
def test_a_spec_survives_its_json_round_trip(spec):
    stored = json.loads(json.dumps(spec.to_params()))
    assert type(spec).from_params(stored) == spec
    assert read_params(spec.kind, stored) == spec


def test_to_params_writes_what_the_front_ends_always_wrote():
    assert CalibrateSpec(samples=3, seq_len=16).to_params() == {"samples": 3, "seq_len": 16, "device": "cpu"}
    # a sweep on one GPU, a bench of every path and the default batch size: no key for them (the pages' tests say so)
    sweep = SensitivitySpec(scheme="W8A16", samples=8).to_params()
    assert "tensor_parallel" not in sweep and "kv_cache" not in sweep and "batch_size" not in sweep
    assert sweep["groups"] is True
    bench = BenchSpec(m=[1, 16, 128]).to_params()
    assert bench == {"device": "cpu", "m": [1, 16, 128], "budget_s": 60.0}
    assert "demo" not in RegisterSpec(source="/x").to_params()


def test_an_old_row_reads_with_the_defaults_where_keys_are_missing_or_unset():
    assert CalibrateSpec.from_params({}) == CalibrateSpec()
    assert CalibrateSpec.from_params(None) == CalibrateSpec()
    # 0, "" and [] were always "unset" to the worker (`params.get(key) or default`)
    old = ScoreSpec.from_params({"scheme": "FP8_DYNAMIC", "samples": 0, "seq_len": None, "device": "",
                                 "tensor_parallel": 0, "kv_cache": "", "label": ""})
    assert old == ScoreSpec(scheme="FP8_DYNAMIC")
    assert BenchSpec.from_params({"m": None, "budget_s": None, "paths": [], "force": False}) == BenchSpec()
    # ... but a stored 0 that means 0 stays
    assert SensitivitySpec.from_params({"scheme": "X", "alpha": 0.0, "groups": False}).alpha == 0.0
    assert SensitivitySpec.from_params({"scheme": "X", "groups": False}).groups is False
    assert ScoreSpec.from_params({"predicted_kl": 0.0}).predicted_kl == 0.0


def test_unknown_keys_of_a_row_are_ignored_as_the_worker_ignored_them():
    row = {"samples": 4, "seq_len": 32, "removed_model": "tiny", "something_new": 1}
    assert CalibrateSpec.from_params(row) == CalibrateSpec(samples=4, seq_len=32)


def test_an_old_row_out_of_range_is_refused_with_the_reason():
    with pytest.raises(InvalidJob, match="samples"):
        CalibrateSpec.from_params({"samples": -3})


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(InvalidJob, match="unknown job kind 'export'.*register, calibrate"):
        spec_class("export")


def test_with_changes_checks_again():
    spec = ScoreSpec(scheme="FP8_DYNAMIC")
    assert spec.with_changes(samples=4).samples == 4
    with pytest.raises(InvalidJob):
        spec.with_changes(samples=0)


# ----------------------------------------------------------------------------- one rule per parameter


def test_every_numeric_parameter_of_every_spec_is_checked_by_its_one_rule():
    """The spec, the CLI's options and the pages read the same Limit: a value just outside it is refused by the
    spec in the rule's own sentence, and the bounds themselves are accepted."""
    cases = [(CalibrateSpec, {}, "samples", SAMPLES), (CalibrateSpec, {}, "seq_len", SEQ_LEN),
             (ScoreSpec, {}, "seq_len", SCORED_SEQ_LEN), (ScoreSpec, {}, "cal_samples", CAL_SAMPLES),
             (ScoreSpec, {}, "cal_seq_len", CAL_SEQ_LEN), (ScoreSpec, {}, "batch_size", BATCH_SIZE),
             (ScoreSpec, {}, "tensor_parallel", TENSOR_PARALLEL), (BenchSpec, {}, "tensor_parallel", TENSOR_PARALLEL),
             (SensitivitySpec, {"scheme": "FP8"}, "alpha", ALPHA), (BenchSpec, {}, "budget_s", BUDGET_S)]
    for spec, given, name, limit in cases:
        low, high = limit.form_bounds()
        assert getattr(spec(**given, **{name: low}), name) == low
        assert getattr(spec(**given, **{name: high}), name) == high
        for bad in ((limit.least if limit.above else limit.least - 1), limit.most * 2):
            with pytest.raises(InvalidJob) as caught:
                spec(**given, **{name: bad})
            assert str(caught.value) == f"a {spec.kind} job's {limit.problem(bad)[1]}"
    assert BenchSpec(m=[1, M_VALUE.most]).m == (1, M_VALUE.most)
    with pytest.raises(InvalidJob, match="m must be between 1 and 16,777,216"):
        BenchSpec(m=[M_VALUE.most + 1])
    assert LIMITS["seq_len"] is SEQ_LEN and LIMITS["budget_s"] is BUDGET_S


def test_a_rule_reads_the_text_a_person_types_and_names_what_is_wrong():
    assert SAMPLES.problem(" 16 ") == (16, None) and BUDGET_S.problem("0.5") == (0.5, None)
    assert SAMPLES.problem("2.5")[1] == "samples must be a whole number of sequences such as 16, got '2.5'"
    assert BUDGET_S.problem("nan")[1] == "budget_s must be a number of seconds such as 60, got 'nan'"
    assert BUDGET_S.problem("-1")[1] == "budget_s must be more than 0 and at most 604,800 seconds, got -1"
    assert SAMPLES.problem(True)[0] is None  # a flag is no count


def test_a_plan_files_tensor_parallel_and_the_jobs_are_refused_in_the_same_words():
    parallel = pytest.importorskip("quantcore.models.parallel")
    from quantcore.errors import PlanError

    for bad in (0, 1025, "two"):
        with pytest.raises(PlanError) as caught:
            parallel.parse_tp(bad)
        assert str(caught.value) == TENSOR_PARALLEL.problem(bad)[1]
    assert parallel.parse_tp(MAX_GPUS) == TENSOR_PARALLEL.check(MAX_GPUS)


def test_a_sequence_longer_than_the_models_context_is_named_with_the_context():
    assert context_problem("--seq-len", 128, 128, "tiny") is None
    assert context_problem("--seq-len", 10**6, None, "tiny") is None  # a context not known refuses nothing
    assert context_problem("--seq-len", 1000, 128, "tiny") == (
        "--seq-len 1000 is longer than tiny's context: its config's max_position_embeddings is 128 tokens")
    assert SEQ_LEN.within(128).form_bounds() == (1, 128) and SEQ_LEN.within(None) is SEQ_LEN
