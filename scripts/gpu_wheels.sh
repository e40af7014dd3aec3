#!/usr/bin/env bash
# Fetch, on this machine (it reaches PyPI), the wheels that the lent GPU machine lacks for
# scripts/gpu_check.sh's product step (database + job path). That machine reaches no registry;
# its image already has torch, transformers, numpy, pandas, pyyaml, pytest and hypothesis
# (see the device tool's KINDS.md). It runs Python 3.12, so the wheels are fetched for cp312.
# The folder .whl/ is git-ignored; name it in the device run's `carry` (about 11 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Versions as pinned / resolved in our .venv (pyproject.toml), so the GPU run tests the same store.
WHEELS=(
  sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 python-dotenv==1.2.4
  celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2 tzlocal==5.4.5
  click==8.5.1 click-didyoumean==0.3.1 click-repl==0.4.1 click-plugins==1.1.1.2
  prompt-toolkit==3.0.53 wcwidth==0.9.4
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do PLATFORMS+=(--platform "$p"); done
rm -rf .whl && mkdir .whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
echo "gpu_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
