#!/usr/bin/env bash
# The GPU checks, as one prepared run for a lent GPU machine (issue #5, docs/results/gpu-h200.md).
#
#   here:           bash scripts/gpu_wheels.sh          # fetches .whl/ for step 4 (that machine has no PyPI)
#   device tool:    run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   any GPU box:    bash scripts/gpu_check.sh           # with a python3 that has CUDA torch
#
# Steps, each logged and each allowed to fail without stopping the others:
#   1. the device: nvidia-smi, torch / CUDA versions
#   2. the `gpu` tests (pytest -m gpu): native flags, kernel vs emulation (FP8, INT8, weight-only
#      INT8 / INT4), FP8 faster than bf16
#      at 2048 x 4096 x 4096 on sm90, INT4 weights faster than bf16 at a 1 x 4096 x 4096 decode GEMM,
#      CUDA fake-quant bit-identical to CPU, KV cache formats and FP8 attention on CUDA as on CPU
#   2b. placement: quantcore.models.placement (which block goes to which GPU; a device_map load; two GPUs if there)
#   3. benchmarks/kernel_gemm.py on the demo model's shapes (SmolLM2-135M) and on Llama-3-8B's,
#      M = 1 16 128 2048 8192, 20 s per shape: JSON records + the Markdown tables for docs/results/gpu-h200.md
#   4. the product path: `quantplan migrate`, then `quantplan bench --device cuda --local` twice
#      into a fresh SQLite home: measured and stored, then reused from the database; then a tiny
#      random-weight Llama registered, calibrated, scored (FP8_DYNAMIC, then with an FP8_ATTN KV cache) and swept
#      (INT8_W8A8 linears, its Fisher estimate, then the FP8_ATTN KV cache a layer at a time) on cuda, whole and
#      block-streamed (calibrate, score, the sweeps, GPTQ, AWQ and rotated sweeps, the Fisher estimate); W4A16_GPTQ
#      scored twice (rounded, then read from the roundings the first job kept); then the Fisher estimate against the
#      six exact sweeps on SmolLM2 (benchmarks/sensitivity_cost.py --fisher)
#   5. rotation: scripts/rotation_check.py, the Hadamard rotation (R1 + R2 + R4) exact on the device, and MXFP4 /
#      INT8 per-tensor KL plain and rotated (issue #46)
# Afterwards `python scripts/gpu_figures.py OUT_DIR` writes the figures into docs/results/gpu-h200.md.
# Writes into $OUT (the device tool's folder) or var/gpu-check: gpu_check.log, summary.txt,
# kernel_smollm2.{json,md}, kernel_llama8b.{json,md}, quantplan_bench.json (7 files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-var/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.txt"
: >"$LOG"
: >"$SUMMARY"
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu BUDGET=1 MS="1 16" bash scripts/gpu_check.sh: a quick dry run on a CPU
read -r -a MS <<<"${MS:-1 16 128 2048 8192}"
# Seconds per (N, K) shape, all M and paths together: 20 keeps the whole run near 6 minutes even where a slow
# path (INT4 weight-only at M = 8192 on Llama-3-8B's 128256-row head) would take longer; such a case is
# reported "over budget" (within a shape the baselines come first, then each path M ascending).
BUDGET=${BUDGET:-20}
BUDGET_ARGS=(--budget "$BUDGET")
M_CSV=$(IFS=,; echo "${MS[*]}")

step() {  # step NAME CMD...: run, log, and note the exit status in summary.txt
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  echo "===== $name: $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "$name: rc=$rc in $(($(date +%s) - t0)) s" | tee -a "$SUMMARY" "$LOG"
  return 0
}

step device bash -c "nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version,clocks.max.sm \
  --format=csv; $PY -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, \
  torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))'"

# the test files that hold `gpu` tests (collecting the whole suite for them took longer than they run), but
# test_placement.py, which is the next step
mapfile -t GPU_TEST_FILES < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu\b' tests | grep -v test_placement.py | sort)
step gpu-tests "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs "${GPU_TEST_FILES[@]}"

# a model over several GPUs (accelerate's device_map): the placement decided on the meta device, a device_map load
# on CUDA giving the one-device logits, and a two-GPU split where the machine has two (skipped, with the count, else)
step placement "$PY" -m pytest -p no:cacheprovider -q -rs tests/quantcore/models/test_placement.py

step kernels-smollm2 "$PY" benchmarks/kernel_gemm.py --device "$DEVICE" --model smollm2-135m --m "${MS[@]}" "${BUDGET_ARGS[@]}" \
  --json "$OUT/kernel_smollm2.json" --markdown "$OUT/kernel_smollm2.md"
step kernels-llama8b "$PY" benchmarks/kernel_gemm.py --device "$DEVICE" --model llama-3-8b --m "${MS[@]}" "${BUDGET_ARGS[@]}" \
  --json "$OUT/kernel_llama8b.json" --markdown "$OUT/kernel_llama8b.md"

if ! "$PY" -c "import sqlalchemy, alembic, celery, pydantic_settings" 2>/dev/null && [ -d .whl ]; then
  SITE=/tmp/quantplan-site
  step wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
export QUANTPLAN_HOME=${GPU_CHECK_HOME:-/tmp/quantplan-gpu-home} QUANTPLAN_USER=gpu-check  # a fresh home
rm -rf "$QUANTPLAN_HOME"
# The Python steps from here on: `$PY ...`, each its own process. A CPU dry run (DEVICE=cpu) runs the very same
# commands through scripts/forkserver.py instead: a process that imported torch, transformers and quantplan once forks
# a fresh child for each (the same code, arguments, environment, output and exit status), so that some twenty tiny
# jobs do not each spend 4-5 s of CPU importing them (the dry run is a test of CI's). GPU_CHECK_FORK=0: plain processes.
PYRUN=("$PY")
if [ "$DEVICE" = cpu ] && [ "${GPU_CHECK_FORK:-1}" = 1 ]; then
  FORK_SOCKET=$(mktemp -u "${TMPDIR:-/tmp}/gpu-check-fork.XXXXXX")
  "$PY" scripts/forkserver.py serve "$FORK_SOCKET" >>"$LOG" 2>&1 &
  FORK_PID=$!
  trap 'kill "$FORK_PID" 2>/dev/null; wait "$FORK_PID" 2>/dev/null; rm -f "$FORK_SOCKET" "$FORK_SOCKET.failed"' EXIT
  PYRUN=("$PY" scripts/forkserver.py run "$FORK_SOCKET")
fi
QP=("${PYRUN[@]}" -m quantplan)
step rotation "${PYRUN[@]}" scripts/rotation_check.py "$DEVICE"  # Hadamard R1/R2/R4 exact on the device (issue #46)
step migrate "${QP[@]}" migrate
step bench-measure bash -c "${QP[*]} bench --device $DEVICE --m $M_CSV --budget $BUDGET \
  --local --json >'$OUT/quantplan_bench.json' \
  && $PY -c 'import json; r = json.load(open(\"$OUT/quantplan_bench.json\")); \
print(len(r), \"records on\", {x[\"device_name\"] for x in r})'"
step bench-reuse "${QP[@]}" bench --device "$DEVICE" --m "$M_CSV" --budget "$BUDGET" --local

# The other job bodies on the device, end to end through the store, on a tiny random-weight Llama made
# here (no weights travel) and the docs' concept pages as the evaluation and calibration text (gensim's corpus does not
# travel).
TINY="$QUANTPLAN_HOME/tiny-llama"
TEXT="$QUANTPLAN_HOME/text.txt"
cat docs/concepts/*.md > "$TEXT"
step tiny-model "${PYRUN[@]}" -c "from pathlib import Path; from tests.factories import save_tiny_llama; \
save_tiny_llama(Path('$TINY'))"
step models-add "${QP[@]}" models add "$TINY" --name tiny
JOB_ARGS=(--text "$TEXT" --samples 4 --seq-len 32 --device "$DEVICE" --local)
step calibrate "${QP[@]}" calibrate tiny "${JOB_ARGS[@]}"
# block-streamed execution (issue 42): the same calibration one decoder block at a time, read from the safetensors
step calibrate-stream "${QP[@]}" calibrate tiny "${JOB_ARGS[@]}" --stream
# score and sensitivity also read calibration text (KV cache scales, GPTQ's Hessians), whose default, gensim's
# corpus, is not on that machine's image: --cal-text
JOB_ARGS+=(--cal-text "$TEXT" --cal-samples 4 --cal-seq-len 32)
step score "${QP[@]}" score tiny --scheme FP8_DYNAMIC "${JOB_ARGS[@]}"
step score-stream "${QP[@]}" score tiny --scheme FP8_DYNAMIC "${JOB_ARGS[@]}" --stream
step sensitivity "${QP[@]}" sensitivity tiny --scheme INT8_W8A8 "${JOB_ARGS[@]}"
# the same sweep streamed (one load of each block for every unit; the rows equal the whole sweep's within CUDA rounding)
step sensitivity-stream "${QP[@]}" sensitivity tiny --scheme INT8_W8A8 "${JOB_ARGS[@]}" --stream
# streamed sweeps of a GPTQ scheme (its layers rounded block by block first, as a streamed score rounds) and of an AWQ
# scheme (its search streamed), on the device
step sensitivity-gptq-stream "${QP[@]}" sensitivity tiny --scheme INT8_W8A8_GPTQ "${JOB_ARGS[@]}" --stream
step sensitivity-awq-stream "${QP[@]}" sensitivity tiny --scheme NVFP4A16_AWQ "${JOB_ARGS[@]}" --stream
# a rotated sweep streamed: each block rotated (R1 + R2 + R4) as it loads, its static scales from a rotated calibration
# that the job runs first, streamed too
step sensitivity-rotated-stream "${QP[@]}" sensitivity tiny --scheme INT8_PER_TENSOR --rotation hadamard \
  "${JOB_ARGS[@]}" --stream
# the fast (Fisher) estimate on the device: backward hooks and quantized GEMMs there; prints its rank correlation with
# the sweep just above (the same tokens: read, not run again)
step fisher "${QP[@]}" sensitivity tiny --scheme INT8_W8A8 --method fisher "${JOB_ARGS[@]}"
# the same estimate block-streamed (block-wise gradient checkpointing: each block run forward, then again backward)
step fisher-stream "${QP[@]}" sensitivity tiny --scheme INT8_W8A8 --method fisher "${JOB_ARGS[@]}" --stream
step fisher-kv-stream "${QP[@]}" sensitivity tiny --kv-cache FP8_ATTN --method fisher "${JOB_ARGS[@]}" --stream
step score-kv "${QP[@]}" score tiny --scheme FP8_DYNAMIC --kv-cache FP8_ATTN "${JOB_ARGS[@]}"
step kv-sweep "${QP[@]}" sensitivity tiny --kv-cache FP8_ATTN "${JOB_ARGS[@]}"
step kv-sweep-stream "${QP[@]}" sensitivity tiny --kv-cache FP8_ATTN "${JOB_ARGS[@]}" --stream
step score-gptq "${QP[@]}" score tiny --scheme W4A16_GPTQ "${JOB_ARGS[@]}"
step score-gptq-kept "${QP[@]}" score tiny --scheme W4A16_GPTQ "${JOB_ARGS[@]}"  # reads the roundings kept
# rollout drift samples token by token with a KV cache on the device (the sampler's generator stays on the CPU);
# a CPU dry run samples fewer, shorter rollouts (tests/quantplan/cli/test_score_rollouts.py covers them on a CPU)
if [ "$DEVICE" = cpu ]; then ROLLOUTS=(--rollouts 2 --rollout-len 16); else ROLLOUTS=(--rollouts 4 --rollout-len 64); fi
step score-rollouts "${QP[@]}" score tiny --scheme FP8_DYNAMIC "${ROLLOUTS[@]}" "${JOB_ARGS[@]}"
step jobs "${QP[@]}" jobs
# the estimate against the six exact sweeps on SmolLM2 where installed (else a random Llama of its shape), side by
# side with a plain forward: docs/concepts/sensitivity.md's figures (a short run on a CPU dry run)
# (a CPU dry run times the tiny Llama instead: the step runs, its figures mean nothing)
if [ "$DEVICE" = cpu ]; then FISHER_TOKENS=(--seqs 1 --seq-len 16 --model "$TINY"); else FISHER_TOKENS=(--seqs 8 --seq-len 256); fi
step fisher-bench "${PYRUN[@]}" benchmarks/sensitivity_cost.py --fisher --device "$DEVICE" "${FISHER_TOKENS[@]}"

echo "===== summary" | tee -a "$LOG"
cat "$SUMMARY" | tee -a "$LOG"
