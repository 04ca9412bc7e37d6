"""Multi-turn episodes with a calculator tool and a verifier: does periodic asynchrony keep its
speedup when generation waits on an environment, strictly on-policy?

    bash experiments/multiturn.sh                       (QUICK=1: a smoke run on a tiny preset)
    python experiments/multiturn.py [--quick] [--repeats 3] [--spreads 1,5,15] [--results results]
        [section.key=value ...]

The task (multiturn.yaml): reasoning-gym's basic_arithmetic with two- and three-digit numbers and
products, on SmolLM2-135M-Instruct. The environment, `periodic_async.episode.envs:CalculatorEnv`:
a `calculator(expression)` tool and a verifier that answers every reply without a tool call
(wrong, with attempts left: "try again"; up to 3 attempts), so its latency is paid on every
episode, not only once the model calls the tool. Each call waits a lognormal time, median 1 s,
99th percentile `--spreads` (seconds; 1 = no spread), drawn from the call's content (a rerun
waits the same): a code sandbox's latency times 5, as generation on CPU is slower (multiturn.yaml).
The calls use the plain-text format (SmolLM2's template renders no tools).

1. Warm start. A 135M model calls no tool it has not seen. The `sft` command trains it
   (sft.episodes) on `WARM_EPISODES` episodes written in TRL's conversational format
   (<runs>/warm_episodes.jsonl): every other one calls the calculator (rendered as
   `<tool_call>calculator(expression="...")</tool_call>`), reads its answer and answers
   `<answer>...</answer>`; the others answer at once. The model's turns are learnt, the tool's
   answer is context. So the warm model knows the format and calls the tool on some questions
   only: RL has a choice to learn (a direct answer to a product of 3-digit numbers is mostly
   wrong, and the verifier's "try again" costs another turn). The tool-use rate and the accuracy
   of greedy episodes on the held-out questions (base, warm, and after RL: periodic-async's
   learning-curve run) go to <results>/multiturn_warm_start.csv.
2. The systems, from the warm start: sync-separated and periodic-async at every spread, and
   sync-colocated and async-offpolicy at the widest, interleaved, `--repeats` rounds of
   `TIMED_ITERATIONS`-iteration runs (bench/protocol.py: medians, min, max, paired ratios; the
   first iteration excluded). At the
   widest spread also sync-separated and periodic-async without the environment (single-turn,
   the same prompts and batch): the single-turn speedup the target compares with. The bound:
   (T_gen + T_train) / max(T_gen, T_train) from the sync-separated runs, as async_speedup.py
   computes it.
3. The learning curve: one run per mode at the widest spread, the yaml's iterations; per
   iteration the reward, the batch accuracy and the tool-use rate (episodes that called the tool).

Writes
  <results>/multiturn.csv             one row per spread and mode: tokens_per_s (median, min, max),
      speedup_vs_sync_separated (ratio of medians; min/max of the same-round ratios), bound,
      efficiency, mean_iteration_s, mean_generate_s, mean_train_s, and for periodic-async at the
      widest spread single_turn_speedup and target_met (multi-turn speedup >= single-turn's);
      repeats, git_commit, config_hash, settings
  <results>/multiturn_curve.csv       mode, iteration, reward_mean, accuracy, tool_use_rate
  <results>/multiturn_warm_start.csv  model (base, warm), tool_use_rate, accuracy, n
  <figures>/multiturn.png             plots.plot_multiturn (notebooks/multiturn.ipynb draws it again)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


from periodic_async.bench.analysis import overlap_bound
from periodic_async.bench.cli import experiment_parser
from periodic_async.bench.plots import plot_multiturn
from periodic_async.bench.protocol import SharedEngines, System, measure
from periodic_async.config import RunConfig, SFTConfig, SFTRunConfig, load_config
from periodic_async.data import load_examples, prompt_messages
from periodic_async.engine import SamplingParams, make_engine, resolve_worker_backend
from periodic_async.episode.envs import CalculatorEnv, evaluate, format_number
from periodic_async.episode.protocol import Environments
from periodic_async.episode.sampler import EpisodeSampler
from periodic_async.model import policy_tokenizer
from periodic_async.pipeline import run
from periodic_async.records import write_csv
from periodic_async.sft import run_sft
from periodic_async.trace import log_experiment, read_jsonl

HERE = Path(__file__).resolve().parent
MODES = ["sync-separated", "periodic-async", "sync-colocated", "async-offpolicy"]
SPREADS = [1.0, 5.0, 15.0]
"""p99 of the tool's and the verifier's latency in seconds (median 1 s, multiturn.yaml): no spread,
some, a code sandbox's (median 0.2 s, p99 3 s) times 5."""
MODE_OVERRIDES = {  # each mode's best setting, as async_speedup.py's real-model: the synchronous modes train
    # the whole batch in large micro-batches; sync-colocated runs both phases on both cores
    "sync-separated": ["algorithm.micro_batch_tokens=4096"],
    "sync-colocated": ["trainer.threads=2", "engine.threads_per_worker=2", "algorithm.micro_batch_tokens=4096"]}
WARM_EPISODES, WARM_STEPS, WARM_BATCH, WARM_LR, WARM_WARMUP = 100, 25, 4, 2e-4, 3
TIMED_ITERATIONS = 2
"""Iterations of each timed run: the first is start-up and excluded, as in async_speedup.py."""
QUICK = ["model.name_or_path=qwen2-1m", "model.tokenizer=artifacts/tokenizer", "engine.backend=local",
         "engine.worker_backend=auto",
         "data.num_train=64", "data.num_eval=4", "engine.max_tokens=16", "env.max_tokens=96",
         "algorithm.prompts_per_iteration=2", "algorithm.group_size=2", "trainer.iterations=2",
         "env.factory_kwargs={attempts: 2, latency: {median_s: 0.2, p99_s: 3.0, scale: 0.05}}"]
QUICK_WARM = dict(episodes=16, steps=4, batch=4, lr=1e-3)


def latency_override(cfg: RunConfig, p99: float) -> str:
    kwargs = {**cfg.env.factory_kwargs, "latency": {**cfg.env.factory_kwargs.get("latency", {}), "p99_s": p99}}
    return f"env.factory_kwargs={kwargs}"


def expression(question: str) -> str:
    """basic_arithmetic's 'Calculate 95 - 21.' -> '95 - 21'."""
    return question.removeprefix("Calculate ").rstrip(". ")


def warm_episodes(cfg: RunConfig, path: Path, episodes: int) -> Path:
    """The warm start's episodes in TRL's conversational format (module docstring, step 1), as JSONL."""
    rows = []
    for i, e in enumerate(load_examples(cfg.data, "train")[:episodes]):
        expr = expression(e.question)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
        tool = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": format_number(evaluate(expr))}]
        answer = [{"role": "assistant", "content": f"<answer>{e.answer}</answer>"}]
        rows.append({"messages": prompt_messages(e, [], cfg.data) + (tool if i % 2 == 0 else []) + answer})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def warm_start(cfg: RunConfig, out: Path, episodes: int, steps: int, batch: int, lr: float) -> Path:
    """The tool-calling warm start: the `sft` command on `warm_episodes` (sft.episodes), saved as a
    model directory in `out`, reused when `out` holds one made with the same settings."""
    settings = {"model": cfg.model.name_or_path, "data": dataclasses.asdict(cfg.data), "episodes": episodes,
                "steps": steps, "batch": batch, "lr": lr}
    stamp = out / "warm_start.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == settings:
        print(f"[multiturn] warm start: reusing {out}")
        return out
    data = warm_episodes(cfg, out.parent / "warm_episodes.jsonl", episodes)
    run_sft(SFTRunConfig(model=cfg.model, data=cfg.data, env=cfg.env, logging=cfg.logging, sft=SFTConfig(
        episodes=str(data), max_steps=steps, batch_size=batch, lr=lr, warmup_steps=WARM_WARMUP, max_minutes=60,
        output_dir=str(out))))
    stamp.write_text(json.dumps(settings))
    return out


def tool_use(cfg: RunConfig) -> dict:
    """Greedy episodes of the held-out questions (no latency), on an in-process engine (vLLM where
    the run's workers would be vLLM, else the built-in one): tool-use rate and accuracy."""
    backend = "vllm" if resolve_worker_backend(cfg.engine, cfg.model) == "vllm" else "local"
    environments = Environments(CalculatorEnv.factory(attempts=cfg.env.factory_kwargs.get("attempts", 1)))
    sampler = EpisodeSampler(policy_tokenizer(cfg.model), environments, cfg)
    with make_engine(cfg.engine, cfg.model, backend=backend) as engine:
        episodes = sampler.greedy(engine, load_examples(cfg.data, "eval"),
                                  SamplingParams(max_tokens=cfg.engine.max_tokens, temperature=0.0))
    n = len(episodes)
    return {"tool_use_rate": round(sum(ep.tool_calls > 0 for ep in episodes) / n, 4),
            "accuracy": round(sum(ep.env_reward or 0.0 for ep in episodes) / n, 4), "n": n}


def main(argv=None) -> list[dict]:
    ap = experiment_parser(__doc__, runs="runs/multiturn", repeats=(3, 1), figures=True, overrides=True)
    ap.add_argument("--spreads", default=",".join(map(str, SPREADS)), help="p99 latencies in seconds (median 1)")
    args = ap.parse_args(argv)
    config, results, runs = HERE / "multiturn.yaml", Path(args.results), Path(args.runs)
    spreads = [SPREADS[-1]] if args.quick else [float(s) for s in args.spreads.split(",")]
    base_overrides = (QUICK if args.quick else []) + args.overrides
    base = load_config(RunConfig, config, base_overrides)
    from periodic_async.model import PRESETS

    if base.model.name_or_path not in PRESETS and not Path(base.model.name_or_path).is_dir():
        sys.exit(f"[multiturn] {base.model.name_or_path} not found: "
                 "python -m periodic_async prepare-model smollm2-135m")
    warm_args = QUICK_WARM if args.quick else dict(episodes=WARM_EPISODES, steps=WARM_STEPS, batch=WARM_BATCH,
                                                   lr=WARM_LR)
    warm = warm_start(base, runs / "warm_start", **warm_args)
    warm_cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, name_or_path=str(warm)))
    warm_rows = [{"model": name, **tool_use(c)} for name, c in (("base", base), ("warm", warm_cfg))]
    write_csv(results / "multiturn_warm_start.csv", warm_rows)
    print(f"[multiturn] tool-use rate {warm_rows[0]['tool_use_rate']} -> {warm_rows[1]['tool_use_rate']}")

    engines = SharedEngines()

    def system(name: str, mode: str, more: list[str]) -> System:
        cfg = load_config(RunConfig, config, base_overrides + MODE_OVERRIDES.get(mode, []) + more + [
            f"model.name_or_path={warm}", f"pipeline.mode={mode}", f"trainer.output_dir={runs}/{name}"])
        return System(name, lambda: run(cfg, engine=engines.get(cfg)), cfg)

    timed = [f"trainer.iterations={TIMED_ITERATIONS}"]
    widest = spreads[-1]
    modes = {p99: MODES if p99 == widest else MODES[:2] for p99 in spreads}  # the others: the separated pair
    systems = [system(f"p99={p99}/{mode}", mode, [latency_override(base, p99)] + timed) for p99 in spreads
               for mode in modes[p99]]
    systems += [system(f"single-turn/{mode}", mode, ["env.factory="] + timed) for mode in MODES[:2]]
    curves = [system(f"curve/{mode}", mode, [latency_override(base, widest)]) for mode in MODES]
    try:
        res = measure(systems, repeats=args.repeats)
    except BaseException:
        engines.close()
        raise
    single = res["single-turn/periodic-async"].ratio(res["single-turn/sync-separated"]).median
    rows = []
    for p99 in spreads:
        sync = res[f"p99={p99}/sync-separated"]
        bound = overlap_bound(sync.stats("mean_generate_s").median, sync.stats("mean_train_s").median)
        for mode in modes[p99]:
            r = res[f"p99={p99}/{mode}"]
            paired = r.ratio(sync)
            row = {"p99_s": p99, "mode": mode, **r.row(["tokens_per_s"], 1),
                   "speedup_vs_sync_separated": round(paired.median, 3), "speedup_min": round(paired.min, 3),
                   "speedup_max": round(paired.max, 3), "bound": round(bound, 3),
                   "efficiency": round(paired.median / bound, 3) if mode != "sync-separated" else "",
                   **{k: round(r.stats(k).median, 3) for k in ("mean_iteration_s", "mean_generate_s", "mean_train_s")}}
            if p99 == widest and mode == "periodic-async":
                row.update(single_turn_speedup=round(single, 3), target_met=paired.median >= single)
            rows.append({**row, **r.provenance()})
    write_csv(results / "multiturn.csv", rows)  # before the curves: a failure there keeps the timings
    print(f"[multiturn] wrote {results}/multiturn.csv")
    try:
        for c in curves:  # the learning curves: one run per mode, the yaml's iterations (not timed)
            print(f"[multiturn] learning curve: {c.name}")
            c.run()
    finally:
        engines.close()
    curve = []
    for mode in MODES:
        for m in read_jsonl(runs / "curve" / mode / "metrics.jsonl"):
            if "episode/tool_use_rate" in m:
                curve.append({"mode": mode, "iteration": m["step"] - 1, "reward_mean": round(m["reward/mean"], 4),
                              "accuracy": round(m["accuracy"], 4),
                              "tool_use_rate": round(m["episode/tool_use_rate"], 4)})
    write_csv(results / "multiturn_curve.csv", curve)
    trained = dataclasses.replace(base, model=dataclasses.replace(base.model, name_or_path=str(
        runs / "curve" / "periodic-async" / "checkpoint")))
    warm_rows.append({"model": "periodic-async, after RL", **tool_use(trained)})
    write_csv(results / "multiturn_warm_start.csv", warm_rows)
    png = plot_multiturn(results / "multiturn.csv", results / "multiturn_curve.csv",
                         Path(args.figures) / "multiturn.png")
    log_experiment("multiturn", [results / f"multiturn{s}.csv" for s in ("", "_curve", "_warm_start")], [png])
    for r in rows:
        print(f"[multiturn] p99 {r['p99_s']:>4} s {r['mode']:16s} {r['tokens_per_s']:8.1f} tokens/s "
              f"x{r['speedup_vs_sync_separated']:.2f} (bound {r['bound']:.2f})")
    print(f"[multiturn] single-turn speedup x{single:.2f}; wrote {results}/multiturn*.csv")
    return rows


if __name__ == "__main__":
    main()
