#!/usr/bin/env bash
# The CPU-scale reproduction, end to end: warm start, then one experiment per paper claim,
# then the tables (docs/results.md, the README's claims) from the results they wrote.
#   bash run_all.sh            full run, one experiment at a time (hours on a 2-core CPU; each
#                              experiment's measured time: docs/reproduce.md)
#   QUICK=1 bash run_all.sh    smoke run of the same code paths at small sizes; implies FORCE=1; two
#                              experiments at a time (LANES=1 for one), each one's output in
#                              $RESULTS_DIR/logs/<experiment>.log (measured times: docs/reproduce.md)
#   FORCE=1 bash run_all.sh    start afresh, though a stopped run could be resumed
#   ONLY=trimodel_cost,soak bash run_all.sh   only these experiments (comma-separated names from
#                              EXPERIMENTS below; an unknown name stops the run before anything runs)
# RESULTS_DIR (default results) redirects every CSV, and the figures to $RESULTS_DIR/figures.
# Each finished experiment's wall time goes to $RESULTS_DIR/logs/run_all_progress.csv; a run
# that stopped part-way resumes with the same command (the experiments it finished are skipped),
# and once every experiment has finished the file is copied to $RESULTS_DIR/run_all_times.csv.
set -euo pipefail
cd "$(dirname "$0")"
# A smoke run never overwrites the committed results: QUICK=1 writes to results/tmp/quick by default.
if [ "${QUICK:-0}" != 0 ]; then export RESULTS_DIR="${RESULTS_DIR:-results/tmp/quick}"; fi
export RESULTS_DIR="${RESULTS_DIR:-results}"
# Figures go beside redirected results, so a smoke run never overwrites the committed ones.
if [ "$RESULTS_DIR" = results ]; then export FIGURES_DIR=figures; else export FIGURES_DIR="$RESULTS_DIR/figures"; fi
FORCE="${FORCE:-0}"; [ "${QUICK:-0}" != 0 ] && FORCE=1
t_all=$SECONDS
step() { echo; echo "=== $* ($(date +%H:%M:%S))"; }

# experiment -> the CSV that says it has run (in RESULTS_DIR)
declare -A MAIN_CSV=(
  [warm_start]=sft.csv [table2_throughput]=table2_throughput.csv [engine_throughput]=engine.csv
  [shared_prompt_ablation]=shared_prompt.csv [trimodel_cost]=trimodel_cost.csv [async_speedup]=async_speedup.csv
  [shared_async]=shared_async.csv [reward_curves]=reward_curves_summary.csv [fig1_timeline]=fig1_timeline.csv
  [equivalence]=equivalence.csv [scaling]=scaling_measured.csv [soak]=soak_summary.csv
  [reward_curves_real]=reward_curves_real_summary.csv [trl_dropin]=trl_dropin.csv [lora]=lora_push.csv
  [reward_curves_tasks]=reward_curves_tasks_summary.csv [multiturn]=multiturn.csv
)
EXPERIMENTS=(warm_start table2_throughput engine_throughput shared_prompt_ablation trimodel_cost async_speedup
             shared_async reward_curves fig1_timeline equivalence scaling soak reward_curves_real trl_dropin lora
             reward_curves_tasks multiturn)
# ONLY: a subset, in EXPERIMENTS' order
if [ -n "${ONLY:-}" ]; then
  IFS=, read -r -a names <<< "$ONLY"
  [[ ",$ONLY," == *,,* ]] && names+=("")  # an empty item (read drops a trailing one)
  for exp in "${names[@]}"; do
    if [ -z "$exp" ] || [ -z "${MAIN_CSV[$exp]:-}" ]; then
      echo "run_all.sh: ONLY=$ONLY: unknown experiment '$exp' (known: ${EXPERIMENTS[*]})" >&2; exit 2
    fi
  done
  chosen=(); for exp in "${EXPERIMENTS[@]}"; do [[ ",$ONLY," == *",$exp,"* ]] && chosen+=("$exp"); done
  EXPERIMENTS=("${chosen[@]}")
fi
source scripts/setup_env.sh
# A smoke run takes two lanes, each running its experiments one after another, split so that both
# take about as long (each experiment's time: $RESULTS_DIR/run_all_times.csv). The second lane takes
# the rest in EXPERIMENTS' order, warm_start first: its model (artifacts/sft-quick) is what
# reward_curves, equivalence and fig1_timeline load. In a smoke run only reward_curves_real and lora
# load SmolLM2-135M: both in the first lane, so no two SmolLM2 experiments run side by side.
FIRST_LANE=(reward_curves_real lora engine_throughput shared_prompt_ablation trimodel_cost)
# Two lanes only for a smoke run: the full run measures times, and two experiments side by side
# would share the cores (and its SmolLM2 experiments would run beside each other).
LANES="${LANES:-$([ "${QUICK:-0}" != 0 ] && echo 2 || echo 1)}"
if [ "$LANES" = 2 ] && [ "${QUICK:-0}" = 0 ]; then
  echo "run_all.sh: LANES=2 is for QUICK=1 only (the full run measures times)"; exit 1
fi
case "$LANES" in 1|2) ;; *) echo "run_all.sh: LANES=$LANES: expected 1 or 2"; exit 1;; esac

experiment() {  # run experiments/$1.sh unless this run (resumed) finished it and its main CSV is there
  local exp=$1 csv="$RESULTS_DIR/${MAIN_CSV[$1]}" t0=$SECONDS log="" rc=0
  local have=0; [ -f "$csv" ] && grep -q "^$exp," "$progress" && have=1  # a CSV alone may be a stopped run's part
  if [ "$exp" = warm_start ] && [ ! -f artifacts/sft-qwen2-1m/config.json ]; then have=0; fi
  if [ "$have" = 1 ]; then echo "skip $exp: finished earlier in this run ($progress)"; return 0; fi
  step "experiment: $exp"
  if [ "$LANES" = 2 ]; then
    log="$RESULTS_DIR/logs/$exp.log"
    bash "experiments/$exp.sh" > "$log" 2>&1 || rc=$?
  else
    bash "experiments/$exp.sh" || rc=$?
  fi
  if [ "$rc" != 0 ]; then
    echo "!!! $exp failed (exit $rc)${log:+; the end of $log:}"
    if [ -n "$log" ]; then tail -n 40 "$log"; fi
    return 1
  fi
  echo "--- $exp: $((SECONDS - t0)) s${log:+ (output: $log)}"
  # every finished experiment's wall time, so that a run resumed later (finished experiments are
  # skipped) still adds up to the whole
  echo "$exp,$((SECONDS - t0)),${QUICK:-0},$commit,$(date -u +%Y-%m-%dT%H:%M:%SZ),$cpu" >> "$progress"
}
lane() {  # the given experiments one after another, up to the first that fails
  local exp
  for exp in "$@"; do experiment "$exp" || return 1; done
}

mkdir -p "$RESULTS_DIR/logs"
progress="$RESULTS_DIR/logs/run_all_progress.csv" times="$RESULTS_DIR/run_all_times.csv"
if [ "$FORCE" != 0 ]; then rm -f "$progress"; fi   # a forced (or smoke) run times every experiment afresh
if [ -f "$progress" ]; then echo "resuming the run in $progress (FORCE=1 starts afresh)"
else echo "experiment,seconds,quick,git_commit,finished,cpu" > "$progress"; fi
# what every CSV records, and the machine each time was measured on: CPU model, widest vector
# unit, cores (times differ severalfold between CPUs)
commit=$(python -c "from periodic_async.records import git_commit; print(git_commit())")
cpu=$(python -c "from periodic_async.records import cpu_name; print(cpu_name())")
for exp in "${EXPERIMENTS[@]}"; do
  [ -f "experiments/$exp.sh" ] || { echo "run_all.sh: experiments/$exp.sh is missing"; exit 1; }
done

# On exit, and when interrupted or stopped (a signal reaches only this shell, not the lanes and
# experiments it started), everything the run started stops: the lanes, their experiments, the
# smoke run's Ray instance.
descendants() { local c; for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done; }
stop_all() {  # the lanes and all below them at once; then the Ray instance, which stops its own processes
  local c pids="" i
  for c in $(pgrep -P $$ 2>/dev/null); do [ "$c" = "${ray_head:-}" ] || pids="$pids $c $(descendants "$c")"; done
  kill $pids 2>/dev/null || true
  if [ -n "${ray_head:-}" ] && kill "$ray_head" 2>/dev/null; then
    for i in $(seq 40); do kill -0 "$ray_head" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 $(descendants "$ray_head") "$ray_head" 2>/dev/null || true
  fi
}
trap stop_all EXIT; trap 'exit 130' INT; trap 'exit 143' TERM

shared_ray() {  # start the smoke run's Ray instance; RAY_ADDRESS names it to every experiment
  local port log="$RESULTS_DIR/logs/ray_head.log" i
  port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  # token authentication (Ray's default for a new instance) also for the experiments joining it;
  # workers at the drivers' priority (Ray's default nice 15 starves them: engine/ray_engine.py)
  export RAY_AUTH_MODE=token RAY_worker_niceness=0
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --block --node-ip-address=127.0.0.1 --port="$port" \
    --num-cpus=$((2 * $(getconf _NPROCESSORS_ONLN))) --include-dashboard=false --disable-usage-stats > "$log" 2>&1 &
  ray_head=$!  # --block: its Ray processes stop with it (stop_all)
  for i in $(seq 240); do
    grep -q "Ray runtime started" "$log" && break
    if ! kill -0 "$ray_head" 2>/dev/null || [ "$i" = 240 ]; then
      tail -n 20 "$log"; echo "run_all.sh: the smoke run's Ray instance did not start ($log; SHARED_RAY=0 skips it)"; exit 1
    fi
    sleep 0.5
  done
  export RAY_ADDRESS="127.0.0.1:$port"
}

step "tokenizer"
python -m periodic_async tokenizer artifacts/tokenizer
# A smoke run's experiments join one Ray instance started here and stopped when the run ends,
# instead of each starting its own (7 s and a core's worth of start-up each): RAY_ADDRESS is what
# engine.ray_address defaults to. It listens on the loopback interface only, so 'auto' core
# pinning applies as to a local start. SHARED_RAY=0: each starts its own, as it does run alone.
if [ "${QUICK:-0}" != 0 ] && [ "${SHARED_RAY:-1}" != 0 ] && [ -z "${RAY_ADDRESS:-}" ]; then
  step "Ray instance for the smoke run"
  shared_ray
  echo "experiments join Ray at $RAY_ADDRESS"
fi
if [ "$LANES" = 1 ]; then
  lane "${EXPERIMENTS[@]}" & only=$!  # in the background: a signal is then handled at once (wait)
  wait "$only" || { echo "run_all.sh: an experiment failed (above)"; exit 1; }
else
  first_lane=() other=()
  for exp in "${FIRST_LANE[@]}"; do [[ " ${EXPERIMENTS[*]} " == *" $exp "* ]] && first_lane+=("$exp"); done
  for exp in "${EXPERIMENTS[@]}"; do [[ " ${FIRST_LANE[*]} " == *" $exp "* ]] || other+=("$exp"); done
  lane "${first_lane[@]}" & first=$!
  lane "${other[@]}" & second=$!
  failed=0; wait "$first" || failed=1; wait "$second" || failed=1
  if [ "$failed" != 0 ]; then echo "run_all.sh: an experiment failed (above)"; exit 1; fi
fi
if [ "$RESULTS_DIR" = results ]; then
  step "tables from results/ (docs/results.md, README.md)"
  python scripts/update_readme.py
fi
cp "$progress" "$times"
echo "done in $((SECONDS - t_all)) s: results in $RESULTS_DIR/, figures in $FIGURES_DIR/"
awk -F, 'NR > 1 { s += $2; n++ } END { printf "experiments timed in %s: %d, %d s in all\n", FILENAME, n, s }' "$times"
