"""The bounded loader every plan file, recipe, import and checkpoint JSON goes through (quantcore.safeload)."""

from __future__ import annotations

import sys
import time

import pytest

from quantcore.errors import PlanError
from quantcore.safeload import json_depth, load_json, load_yaml, read_input, short, short_name


def test_plain_yaml_is_read_as_plain_data():
    assert load_yaml("default: FP8\nrules: [{match: x, scheme: BF16}]\n", "p.yaml", PlanError) == {
        "default": "FP8", "rules": [{"match": "x", "scheme": "BF16"}]}


@pytest.mark.parametrize("text", ["a: &x 1\nb: *x\n", "a: &x [1]\n", "base: &b {k: 1}\nother:\n  <<: *b\n"])
def test_yaml_anchors_and_aliases_are_refused_naming_the_file_and_line(text):
    with pytest.raises(PlanError, match=r"^p\.yaml uses YAML anchors or aliases .* \(line \d"):
        load_yaml(text, "p.yaml", PlanError)


def test_yaml_nested_past_the_cap_is_refused_without_a_recursion_error():
    with pytest.raises(PlanError, match="p.yaml nests deeper than 64 levels"):
        load_yaml("a: " + "[" * 50_000 + "]" * 50_000, "p.yaml", PlanError)


def test_a_python_tag_is_not_constructed():
    with pytest.raises(PlanError, match="not valid YAML"):
        load_yaml("default: !!python/object/apply:os.system ['true']\n", "p.yaml", PlanError)


@pytest.mark.parametrize("data", [b"\xa7\x00\x01GGUF", "default: FP8\x00", "default: \ufffd\ufffd"])
def test_binary_input_is_said_to_be_no_text_file(data):
    with pytest.raises(PlanError, match=r"^p\.yaml is not a text file"):
        load_yaml(data, "p.yaml", PlanError)


def test_input_over_the_size_cap_is_refused_before_parsing():
    with pytest.raises(PlanError, match="p.yaml is 2.0 MiB, above the 1.0 MiB"):
        load_yaml("x" * (2 * 2**20), "p.yaml", PlanError, max_bytes=2**20)


def test_a_yaml_mistake_quotes_one_line_cut_short():
    with pytest.raises(PlanError) as info:
        load_yaml("default: FP8\nrules: [" + "x" * 10_000 + "\n", "p.yaml", PlanError)
    assert len(str(info.value)) < 400 and "p.yaml is not valid YAML" in str(info.value)


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": "[[[[{{", "b": [1, {"c": [2]}]}') == 4
    assert json_depth(b'"just a string"') == 0


def test_deep_json_is_refused_before_json_loads_and_fast():
    start = time.perf_counter()
    with pytest.raises(PlanError, match=r"config.json nests 1,000,000 levels deep"):
        load_json(b"[" * 1_000_000 + b"]" * 1_000_000, "config.json", PlanError)
    assert time.perf_counter() - start < 10
    assert sys.getrecursionlimit() < 1_000_000


def test_invalid_json_names_the_file_line_and_quotes_it():
    with pytest.raises(PlanError, match=r"config.json is not valid JSON \(line 2, column 7: .*'\"b\": }'"):
        load_json(b'{"a": 1,\n "b": }', "config.json", PlanError)


def test_read_input_refuses_a_large_file_before_reading_it(tmp_path):
    big = tmp_path / "big.yaml"
    with big.open("wb") as handle:
        handle.truncate(10 * 2**20)  # sparse: 10 MiB of size, no bytes written
    with pytest.raises(PlanError, match="plan file .*big.yaml' is 10.0 MiB"):
        read_input(big, PlanError, what="plan file")


def test_long_names_and_quotes_are_cut():
    assert len(short_name("a" * 5000)) < 160 and "5,000 characters" in short_name("a" * 5000)
    assert short("x\n" * 500) .startswith("x x") and len(short("x\n" * 500)) == 80
