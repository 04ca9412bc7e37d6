#!/usr/bin/env bash
# First light on a GPU: the paper's claims checked on one CUDA device, then what they cost there,
# in under 8 minutes on an H200 (the sum of the step limits below is 8 minutes):
#
#   bash scripts/gpu_wheels.sh build/gpu-wheels                       # here, once (needs pip's index)
#   WHEELS=build/gpu-wheels PYTHON=python3 bash scripts/gpu_check.sh OUT   # on the GPU machine
#
# Needs only torch (CUDA) and transformers in PYTHON; the few other dependencies it imports come
# from the wheel folder WHEELS (installed into a temporary directory, and only those the machine
# lacks). Ray, vLLM, W&B and TRL are optional: what needs them says "skipped: not installed".
# Steps (src/periodic_async/bench/gpu/, a module each; each a process with its own time limit, printed,
# and a deadline inside it, so a failing or slow step never hides the others' rows):
#   preflight    CUDA present (else exit 2 with one line), dependencies, environment
#   correctness  OUT/correctness.csv  device run = CPU run; periodic-async = sync-separated on the
#                device; shared-prompt = per-response log-probs per back-end; the after-push probe
#                gap in bf16; a short periodic-async run in bf16
#   attention    OUT/attention.csv    fwd+bwd per group, shared vs per-response, per back-end,
#                Qwen2.5-1.5B architecture, P 1024/4096, G 16, R 256/1024, with the token bound
#   trainer      OUT/trainer.csv      tri-model micro-step tokens/s, MFU, peak memory (0.5B, 1.5B)
#   engine       OUT/engine.csv       built-in engine decode tokens/s at 64 / 256 slots vs HF generate
#   ray-workers  only when ray and pytest are installed: `pytest -m gpu tests/test_gpu.py`
# Every CSV row carries commit, source hash, GPU name, torch and CUDA versions. All output goes to
# OUT/gpu_check.log. Exit status: 0 all passed, 1 some step failed, 2 no CUDA device, 3 missing
# dependencies.
#
# Environment: PYTHON (default .venv/bin/python, else python3), WHEELS (wheel folder),
# GPU_CHECK_DEVICE=cpu and GPU_CHECK_TOY=1 (the same steps on a CPU at toy sizes: how the CPU
# tests run it), GPU_CHECK_COMMIT (the commit, when the copy has no git history),
# GPU_CHECK_ARGS (extra arguments for every step, e.g. "--peak-tflops 835"), GPU_CHECK_STEPS (a
# subset, e.g. "attention engine", to rerun only those).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: [WHEELS=DIR] [PYTHON=python3] bash scripts/gpu_check.sh OUT}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
: > "$LOG"
T0=$SECONDS
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WORK="${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
mkdir -p "$WORK"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled RAY_USAGE_STATS_ENABLED=0

log() { echo "$*" | tee -a "$LOG"; }

# The wheel folder: install (into WORK/site) only the packages this interpreter lacks, so a
# working numpy or tokenizers of the machine is never shadowed by ours.
if [ -n "${WHEELS:-}" ]; then
  site="$WORK/site"
  mkdir -p "$site"
  while read -r dist module; do
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" 2>/dev/null && continue
    shopt -s nullglob nocaseglob
    found=("$WHEELS"/"$dist"-*.whl "$WHEELS"/"${dist//-/_}"-*.whl)
    shopt -u nullglob nocaseglob
    if [ ${#found[@]} -eq 0 ]; then log "wheels: $module is missing and $WHEELS has no $dist wheel"; continue; fi
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${found[0]}" >> "$LOG" 2>&1; then
      "$PY" -m zipfile -e "${found[0]}" "$site" >> "$LOG" 2>&1  # no pip: a wheel is a zip archive
    fi
    log "wheels: installed $(basename "${found[0]}") (no $module here)"
  done < <(bash scripts/gpu_wheels.sh --modules)
  export PYTHONPATH="$PWD/src:$site${PYTHONPATH#"$PWD/src"}"
fi

DEVICE="${GPU_CHECK_DEVICE:-cuda}"
args=(--out "$OUT" --work "$WORK" --device "$DEVICE")
[ "${GPU_CHECK_TOY:-0}" != 0 ] && args+=(--toy)
if [ -n "${GPU_CHECK_ARGS:-}" ]; then read -r -a extra <<< "$GPU_CHECK_ARGS"; args+=("${extra[@]}"); fi
check=("$PY" -m periodic_async.bench.gpu)

# preflight: exit 2 without CUDA (its one line on stderr), 3 with a dependency missing
timeout -k 5 40 "${check[@]}" preflight "${args[@]}" >> "$LOG" 2> "$WORK/preflight.err"
rc=$?
cat "$WORK/preflight.err" >> "$LOG"
if [ $rc -ne 0 ]; then
  if [ -s "$WORK/preflight.err" ]; then tail -n 1 "$WORK/preflight.err" >&2
  else echo "gpu_check: preflight failed (rc $rc; 124 = time limit): see $LOG" >&2; fi
  [ $rc -eq 2 ] || [ $rc -eq 3 ] || rc=1
  exit $rc
fi
grep -E "^(environment|device|optional)" "$LOG"
if [ "$DEVICE" != cpu ] && command -v nvidia-smi > /dev/null; then
  { echo "== nvidia-smi"; nvidia-smi; } >> "$LOG" 2>&1
fi

failed=()
step() {  # step NAME LIMIT_S: one step of bench/gpu, its deadline 15 s inside the limit
  local name=$1 limit=$2 start=$SECONDS
  log "== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "${check[@]}" "$name" "${args[@]}" --budget-s $((limit - 15)) > "$WORK/$name.log" 2>&1
  local rc=$?
  cat "$WORK/$name.log" >> "$LOG"
  if [ $rc -eq 0 ]; then
    log "   ok in $((SECONDS - start))s: $(grep "^gpu_check $name:" "$WORK/$name.log" | tail -n 1)"
  else
    log "   FAILED (rc $rc; 124 = time limit) in $((SECONDS - start))s; the rows it wrote are in $OUT/$name.csv"
    grep -E "status=FAILED|Error|error" "$WORK/$name.log" | tail -n 8
    failed+=("$name")
  fi
}

declare -A LIMIT=([correctness]=140 [attention]=150 [trainer]=75 [engine]=75)
for name in ${GPU_CHECK_STEPS:-correctness attention trainer engine}; do
  if [ -z "${LIMIT[$name]:-}" ]; then log "gpu_check: unknown step $name (GPU_CHECK_STEPS)"; failed+=("$name"); continue; fi
  step "$name" "${LIMIT[$name]}"
done

# What needs Ray (and vLLM, when installed): the pytest GPU tests, in whatever time is left of 8 minutes
if [ "$DEVICE" = cpu ]; then
  log "ray-workers: skipped: needs CUDA"
elif ! "$PY" -c "import ray, pytest" > /dev/null 2>&1; then
  log "ray-workers: skipped: not installed (ray and pytest; the Ray engine workers and collective sync)"
  "$PY" -c "import vllm" > /dev/null 2>&1 || log "vllm: skipped: not installed"
else
  left=$((470 - (SECONDS - T0)))
  if [ $left -lt 30 ]; then
    log "ray-workers: skipped: time budget (${left}s left of 8 minutes)"
  else
    log "== ray-workers (limit ${left}s): pytest -m gpu tests/test_gpu.py"
    timeout -k 10 "$left" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_gpu.py >> "$LOG" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then log "   ok"; else log "   FAILED (rc $rc)"; failed+=(ray-workers); fi
  fi
fi

log "== results ($((SECONDS - T0))s in all)"
for f in "$OUT"/*.csv; do
  [ -f "$f" ] || continue
  n=$(($(wc -l < "$f") - 1))
  bad=$(grep -cE ",\"?FAILED" "$f")
  log "   $(basename "$f"): $n rows, $bad failed"
done
if [ ${#failed[@]} -gt 0 ]; then
  log "gpu_check: FAILED steps: ${failed[*]} (log: $LOG)"
  exit 1
fi
log "gpu_check: all steps passed (log: $LOG)"
