"""Do the two phases slow each other when they overlap, and why? The pipeline's phases reduced
to two bare processes on two cores, without Ray, the producer or the queue:

    trainer   forward + backward + AdamW of the model on one 256-token row, one thread, in a loop
    engine    the built-in continuous batcher decoding 16 sequences (2 groups of 8, up to 48 tokens), one thread

    python experiments/phase_contention.py [--repeats 3] [--seconds 8]
                                           [--models artifacts/sft-qwen2-1m artifacts/smollm2-135m-instruct]

Cases, interleaved over `--repeats` rounds (medians with min and max):
    alone          each process by itself, pinned to its core (trainer: the second core, engine: the first)
    pinned         both at once, each pinned to its own core
    unpinned       both at once, left to the OS scheduler
    trainer_waits  the trainer alone, sleeping 20 ms before each step, as the periodic-async
                   consumer waits for each group (an idle core is halted and woken again)

Each model (--models; a missing directory is skipped) is measured the same way: the tiny warm
start fits in the caches, SmolLM2-135M (540 MB of fp32 weights, read at every decode step and
trained with AdamW's 2 GB of state) does not.

Writes <results>/phase_contention.csv: model, case, process, rate (trainer steps/s or engine tokens/s),
rate_min, rate_max, vs_alone (median rate over the alone median), step_cpu_ms (the trainer's
CPU time per step: the same work computed slower shows here, a wait does not), repeats,
git_commit, cpu. If `pinned` keeps both near 1.0 the machine's cores do not slow each other,
and what the pipeline loses when its phases overlap comes from the processes themselves.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.records import write_csv
from periodic_async.parallel.affinity import available_cores

TRAINER = r'''
import os, sys, time, torch
core, seconds, model, gap = sys.argv[1:5]
if core != "-": os.sched_setaffinity(0, [int(core)])
torch.set_num_threads(1)
from periodic_async.config import ModelConfig
from periodic_async.model import load_policy
m, _ = load_policy(ModelConfig(name_or_path=model, dtype="float32", tokenizer=sys.argv[5]))
opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
x = torch.randint(5, 400, (1, 256))
def step():
    m(x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
for _ in range(3): step()
print("ready", flush=True); sys.stdin.readline()
t, n, cpu = time.perf_counter(), 0, 0.0
while time.perf_counter() - t < float(seconds):
    if float(gap): time.sleep(float(gap))
    c = time.thread_time(); step(); cpu += time.thread_time() - c; n += 1
print(n / (time.perf_counter() - t), 1000 * cpu / n)
'''
ENGINE = r'''
import os, sys, time, torch
core, seconds, model, gap = sys.argv[1:5]
if core != "-": os.sched_setaffinity(0, [int(core)])
torch.set_num_threads(1)
from periodic_async.config import ModelConfig
from periodic_async.model import load_policy
from periodic_async.engine.batcher import ContinuousBatcher
from periodic_async.engine.base import Request, SamplingParams
m, tok = load_policy(ModelConfig(name_or_path=model, dtype="float32", tokenizer=sys.argv[5]))
b = ContinuousBatcher(m, tok, 16)
p = SamplingParams(max_tokens=48, temperature=1.0, ignore_eos=True)
def submit(i):
    b.submit([Request(f"r{i}-{j}", [5 + j, 9, 17, 33], 8, p, seed=j) for j in range(2)])
submit(-1)
for _ in range(3): b.step()
print("ready", flush=True); sys.stdin.readline()
t, steps, i = time.perf_counter(), 0, 0
while time.perf_counter() - t < float(seconds):  # 16 sequences decoding: refilled as they finish
    if not b.has_work: submit(i); i += 1
    b.step(); steps += 1
print(16 * steps / (time.perf_counter() - t), 0)
'''
CASES = {  # case: [(process, core index or None, gap between trainer steps)]
    "alone-trainer": [("trainer", 1, 0.0)],
    "alone-engine": [("engine", 0, 0.0)],
    "pinned": [("trainer", 1, 0.0), ("engine", 0, 0.0)],
    "unpinned": [("trainer", None, 0.0), ("engine", None, 0.0)],
    "trainer_waits": [("trainer", 1, 0.02)],
}


def run_case(procs, cores, seconds: float, model: str, tokenizer: str) -> dict[str, tuple[float, float]]:
    """Start the case's processes, wait until each has loaded its model, then measure them at once."""
    started = []
    for name, core, gap in procs:
        code = TRAINER if name == "trainer" else ENGINE
        pin = "-" if core is None else str(cores[core])
        p = subprocess.Popen([sys.executable, "-c", code, pin, str(seconds), model, str(gap), tokenizer],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append((name, p))
    for _, p in started:
        assert p.stdout.readline().strip() == "ready"
    for _, p in started:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = {}
    for name, p in started:
        rate, cpu_ms = p.communicate(timeout=600)[0].split()[-2:]
        out[name] = (float(rate), float(cpu_ms))
    return out


def main(argv=None) -> list[dict]:
    ap = experiment_parser(__doc__, repeats=(3, 3), quick=False)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--models", nargs="+", default=["artifacts/sft-qwen2-1m", "artifacts/smollm2-135m-instruct"])
    ap.add_argument("--tokenizer", default="artifacts/tokenizer")
    args = ap.parse_args(argv)
    cores = available_cores()
    if len(cores) < 2:
        sys.exit("phase_contention needs 2 cores")
    models = [m for m in args.models if Path(m).is_dir()] or ["qwen2-1m"]
    rows = []
    for model in models:
        seen: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(args.repeats):  # interleaved: every case once per round
            for case, procs in CASES.items():
                for name, value in run_case(procs, cores, args.seconds, model, args.tokenizer).items():
                    seen.setdefault((case, name), []).append(value)
                print(f"[phase_contention] {Path(model).name} round {r + 1}/{args.repeats} {case}: "
                      f"{ {n: round(v[-1][0], 2) for (c, n), v in seen.items() if c == case} }", flush=True)
        alone = {n: statistics.median(v[0] for v in seen[(f"alone-{n}", n)]) for n in ("trainer", "engine")}
        for (case, name), values in seen.items():
            rates = [v[0] for v in values]
            rows.append({"model": Path(model).name, "case": "alone" if case.startswith("alone") else case,
                         "process": name, "rate": round(statistics.median(rates), 2), "rate_min": round(min(rates), 2),
                         "rate_max": round(max(rates), 2), "vs_alone": round(statistics.median(rates) / alone[name], 3),
                         "step_cpu_ms": round(statistics.median(v[1] for v in values), 2) if name == "trainer" else "",
                         "repeats": len(values)})
    out = write_csv(Path(args.results) / "phase_contention.csv", rows)
    for row in rows:
        print(row)
    print(f"[phase_contention] wrote {out}")
    return rows


if __name__ == "__main__":
    main()
