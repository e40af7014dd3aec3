#!/usr/bin/env bash
# Create or refresh .venv-llmc: a virtual environment with the real llm-compressor, kept apart from
# .venv because llmcompressor 0.14.0.1 pins transformers<=5.17 while quantplan uses 5.24.
# tests/quantcore/test_llmcompressor.py loads exported recipes there (scripts/llmc_check.py).
#
#   scripts/llmc_env.sh            # idempotent: does nothing when the stamp matches
#   PYTHON=python3.11 scripts/llmc_env.sh
#   LLMC_PIP_ARGS="--extra-index-url <a CPU torch index>" scripts/llmc_env.sh
#
# What it installs (measured here, 2 cores, Python 3.11): torch 2.13.0, llmcompressor 0.14.0.1 and
# their dependencies, each pinned by scripts/llmc-constraints.txt (transformers 5.17, compressed-tensors
# 0.19.0, datasets, accelerate, auto-round, pandas, pyarrow...), about 1.5 GB on disk, about 2 minutes. pip takes torch from any local wheel
# folder its configuration names (find-links); on a machine with nothing but PyPI it downloads
# PyPI's torch 2.13.0, the CUDA build (several GB with its nvidia-* wheels): set LLMC_PIP_ARGS to a
# CPU wheel index where one is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${LLMC_VENV:-.venv-llmc}
REQUIREMENTS="torch==2.13.0 llmcompressor==0.14.0.1"
STAMP="$VENV/.quantplan-llmc-stamp"
LOCK="$VENV/.quantplan-llmc.lock"

CONSTRAINTS=scripts/llmc-constraints.txt  # every transitive dependency frozen: produced checkpoints stay comparable

want=$( (echo "$REQUIREMENTS ${LLMC_PIP_ARGS:-}"; cat "$0" "$CONSTRAINTS") | sha256sum | cut -d' ' -f1)

build() {
  if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return 0
  fi
  echo "llmc_env: setting up $VENV ($REQUIREMENTS); first run takes a few minutes" >&2
  rm -f "$STAMP"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  # shellcheck disable=SC2086  # word splitting of the requirement list and extra pip args is intended
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check ${LLMC_PIP_ARGS:-} -c "$CONSTRAINTS" $REQUIREMENTS
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for dist, want in (("llmcompressor", "0.14.0.1"), ("torch", "2.13.0")):
    have = md.version(dist)
    assert have.split("+")[0] == want, f"{dist} {have} installed, {want} wanted"
import llmcompressor.recipe  # noqa: F401  (the import the checks need)
PY
  echo "$want" > "$STAMP"
  echo "llmc_env: $VENV ready" >&2
}

mkdir -p "$VENV"
# keep the whole environment out of git without touching the repository's .gitignore
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"
if command -v flock >/dev/null 2>&1; then
  # two test processes may ask at once: the second waits for the first instead of racing pip
  exec 9>"$LOCK"
  flock 9
fi
build
