"""One script, two libraries: examples/trl_grpo.py (TRL's GRPOTrainer shape) run as written on
periodic_async and with its import line switched to TRL's, on SmolLM2-135M-Instruct; the time per
optimizer step of each, measured the same way (the interval between the first reward calls of
consecutive steps, start-up step left out; see the script).

    python experiments/trl_dropin.py [--quick] [--repeats 3] [--max-steps 6] [--results results]

Each run is a fresh process of the same file, differing in that one line (`from trl import ...`
vs `from periodic_async import ...`); every other setting is the script's: B=4 prompts x G=4,
64 new tokens, lr 1e-5, fp32, TRL generating with `transformers.generate` (TRL's default,
use_vllm=False), ours with its defaults (periodic-async, shared prompt, one engine worker: vLLM
for this model when installed). Protocol (periodic_async.bench): the two interleaved, `--repeats`
rounds, medians with min and max, and the paired per-round ratio. --quick: the same two scripts
on the tiny qwen2-1m preset (random weights, the project's tokenizer), exported as a model
directory: the same code paths without SmolLM2's start-up (its loads and its vLLM engine), which the
smoke run's real-model experiments exercise. Writes
<results>/trl_dropin.csv (system, step_s, step_s_min, step_s_max, speedup, speedup_min,
speedup_max, train_s, repeats, git_commit, config_hash, settings).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.protocol import System, measure
from periodic_async.records import write_csv
from periodic_async.bench.trl import export_model
from periodic_async.config import ModelConfig, RunConfig
from periodic_async.data.tokenizer import ensure_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "trl_grpo.py"
OURS = "from periodic_async import GRPOConfig, GRPOTrainer"
IMPORTS = {"periodic-async": OURS, "trl": "from trl import GRPOConfig, GRPOTrainer"}
COLUMNS = ["system", "step_s", "step_s_min", "step_s_max", "speedup", "speedup_min", "speedup_max", "train_s",
           "train_s_min", "train_s_max", "repeats", "git_commit", "config_hash", "settings"]


def script_for(system: str, folder: Path) -> Path:
    """examples/trl_grpo.py with its import line set for `system` (the only line that differs)."""
    text = SCRIPT.read_text()
    if text.count(OURS) != 1:
        raise RuntimeError(f"{SCRIPT}: expected the line {OURS!r} exactly once")
    path = folder / f"trl_grpo_{system}.py"
    path.write_text(text.replace(OURS, IMPORTS[system]))
    return path


def run_script(path: Path, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{path.name} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("STEP_TIMES "))
    times = json.loads(line.removeprefix("STEP_TIMES "))
    return {"step_s": times["step_s"], "train_s": times["train_s"], "global_step": times["global_step"]}


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, runs="runs/trl_dropin", repeats=(3, 1))
    ap.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (default 6; 3 with --quick)")
    ap.add_argument("--model", default=None,
                    help="model directory (default artifacts/smollm2-135m-instruct; with --quick the qwen2-1m preset)")
    args = ap.parse_args(argv)
    repeats = args.repeats
    steps = args.max_steps or (3 if args.quick else 6)
    extra = ["--max-completion-length", "8", "--prompts-per-step", "2", "--num-generations", "2"] if args.quick else []
    folder = Path(tempfile.mkdtemp(prefix="trl_dropin_"))
    model = args.model or str(ROOT / "artifacts" / "smollm2-135m-instruct")
    if args.quick and args.model is None:  # the tiny preset as a model directory, as both libraries load it
        tokenizer = str(ROOT / "artifacts" / "tokenizer")
        ensure_tokenizer(tokenizer)
        model = str(export_model(RunConfig(model=ModelConfig(name_or_path="qwen2-1m", tokenizer=tokenizer)),
                                 Path(args.runs) / "qwen2-1m"))
    systems = []
    for name in IMPORTS:
        path = script_for(name, folder)
        cli = ["--model", model, "--output-dir", f"{args.runs}/{name}", "--max-steps", str(steps), *extra]
        settings = {"script": "examples/trl_grpo.py", "import": IMPORTS[name], "max_steps": steps,
                    "args": " ".join(extra)}
        systems.append(System(name, lambda path=path, cli=cli: run_script(path, cli), settings=settings))
    results = measure(systems, repeats=repeats)
    ours, trl = results["periodic-async"], results["trl"]
    rows = []
    for r in (ours, trl):
        speed = trl.ratio(r, "step_s")  # TRL's step time over this system's: > 1 is faster than TRL
        row = {"system": r.name, **r.row(["step_s", "train_s"]), "speedup": round(speed.median, 3),
               "speedup_min": round(speed.min, 3), "speedup_max": round(speed.max, 3)}
        rows.append({**row, **r.provenance()})
    path = write_csv(Path(args.results) / "trl_dropin.csv", rows, COLUMNS)
    print(f"[trl_dropin] wrote {path}")
    for row in rows:
        print(f"  {row['system']:>15}: {row['step_s']} s/step ({row['step_s_min']}-{row['step_s_max']}), "
              f"{row['speedup']}x TRL")


if __name__ == "__main__":
    main()
