"""LoRA against full fine-tuning (beyond the paper): what the barrier pushes and what the tri-model holds.

With `model.lora.enabled` the paper's two fixed costs shrink: the barrier pushes the adapter
alone, and the unified tri-model keeps one base (the reference is the base with the adapter
off; the old policy a copy of the adapter tensors). Measured on SmolLM2-135M-Instruct, fp32,
LoRA r=16 (alpha 32) on all seven linear projections, one thread:

1. push (results/lora_push.csv): per engine (the built-in engine in this process, vLLM in this
   process), the bytes of one push and the seconds of reading it off the trainer (extract_s:
   what Consumer.engine_state_dict does; with LoRA a copy of the adapter), of the engine's update
   (push_s) and of its check (check_s: the probe's log-probs on the engine against the
   trainer's); push_check_s is the three together, median over versions 2..V of one process
   (version 1 is the engine's first push); then the engine's sampling speed through what the
   last push left (gen_tok_s: 8 requests x 32 tokens, eos ignored; with LoRA through the
   adapter). One process per (engine, mode): a process holds one vLLM engine. The two modes
   alternate round by round; ratios are medians of per-round ratios.
2. tri-model (results/lora_trimodel.csv): parameter bytes of policy + old + ref, and one
   micro-step's time (2 groups x 4 responses x 64 tokens after a 128-token prompt), LoRA
   against full, with every model kept (beta > 0, two optimizer steps per iteration) and in the
   default (beta = 0, one step: policy only); variants interleaved round by round in one process.
   The trainer's peak memory (peak_rss_mib, on the all_kept rows): the peak resident set of a
   process that loads the policy and runs one such micro-step and one AdamW step (interpreter
   and libraries included), one process per mode and round.
3. iteration (results/lora_iteration.csv): sync-separated and periodic-async, full and LoRA, on
   async_speedup_real.yaml's deployment at B=8 (`iteration_rounds`), interleaved rounds.
4. learning (results/lora_learning.csv, results/reward_curves_real_lora{,_summary}.csv): the
   full fine-tuning curve's workload (reward_curves_real.yaml) with LoRA, its learning rate chosen
   by a short sweep (3 rates x 4 iterations, ranked by greedy accuracy on a validation draw:
   `learning`), then held-out accuracy before and after the curve's 20 iterations.

    bash experiments/lora.sh            # 3 rounds of each part, then the learning runs (about 2 hours)
    QUICK=1 bash experiments/lora.sh    # 1 round, 2 versions, vLLM only, a small micro-batch, a toy sweep
    python experiments/lora.py --parts learning    # some parts (trimodel, push, iteration, learning)
    python experiments/lora.py --parts sweep       # the learning-rate sweep alone (an earlier final run kept)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODEL = "artifacts/smollm2-135m-instruct"
LORA = {"rank": 16, "alpha": 32.0}


def _model_cfg(path: str, lora: bool):
    from periodic_async.config import LoRAConfig, ModelConfig

    return ModelConfig(name_or_path=path, tokenizer=path, device="cpu", dtype="float32",
                       lora=LoRAConfig(enabled=lora, **LORA))


def push_one(engine_name: str, mode: str, versions: int, path: str) -> dict:
    """One process: start the engine, push `versions` versions of a moving policy, check each."""
    from periodic_async.config import EngineConfig
    from periodic_async.engine import make_engine
    from periodic_async.engine.verify import PushCheck, probe_tokens
    from periodic_async.model import load_policy

    torch.set_num_threads(1)
    lora = mode == "lora"
    cfg = _model_cfg(path, lora)
    policy, _ = load_policy(cfg)
    gen = torch.Generator().manual_seed(0)
    engine = make_engine(EngineConfig(backend=engine_name, max_num_seqs=8, vllm_kv_cache_gib=0.5), cfg)
    check = PushCheck(policy, probe_tokens(policy.config.vocab_size), 1e-3)
    rows = []
    try:
        for v in range(1, versions + 1):
            with torch.no_grad():  # a training step's worth of change to what is trained
                for p in policy.parameters():
                    if p.requires_grad:
                        p.add_((0.02 if lora else 1e-3) * torch.randn(p.shape, generator=gen))
            t0 = time.perf_counter()
            if lora:  # what the consumer pushes (Consumer.engine_state_dict)
                from periodic_async.lora import adapter_parameters

                state = {n: t.detach().to("cpu", copy=True) for n, t in adapter_parameters(policy).items()}
            else:
                state = {n: t.detach() for n, t in policy.state_dict().items()}
            extract_s = time.perf_counter() - t0
            unique = {t.data_ptr(): t for t in state.values()}.values()
            push_s = engine.update_weights(state, v)
            gaps = check.after_push(engine, v, push_s)
            rows.append({"extract_s": extract_s, "push_s": push_s, "check_s": check.last["time/verify_s"],
                         "gap": float(gaps[0]), "bytes": sum(t.numel() * t.element_size() for t in unique),
                         "tensors": len(state)})
        from periodic_async.engine.base import Request, SamplingParams

        # generation through what the last push left (the adapter with LoRA): 8 slots x 32 tokens each
        prompts = [probe_tokens(policy.config.vocab_size, 24, seed=s) for s in range(8)]
        reqs = [Request(f"gen-{i}", p, 1, SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True), i)
                for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        tokens = sum(len(smp.token_ids) for out in engine.generate(reqs) for smp in out.samples)
        gen_tok_s = tokens / (time.perf_counter() - t0)
    finally:
        engine.close()
    steady = rows[1:] or rows
    out = {k: statistics.median(r[k] for r in steady) for k in ("extract_s", "push_s", "check_s")}
    out["gen_tok_s"] = round(gen_tok_s, 1)
    out.update(bytes=rows[0]["bytes"], tensors=rows[0]["tensors"], max_gap=max(r["gap"] for r in rows),
               versions=len(steady))
    return out


def push_rounds(engines: list[str], rounds: int, versions: int, path: str) -> list[dict]:
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(rounds):
        for engine_name in engines:
            modes = ["full", "lora"] if rnd % 2 == 0 else ["lora", "full"]
            for mode in modes:
                r = subprocess.run([sys.executable, __file__, "push-one", engine_name, mode, str(versions), path],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"lora.py: {engine_name}/{mode} failed:\n{r.stderr[-3000:]}")
                result = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"[lora] round {rnd + 1}/{rounds} {engine_name} {mode}: {result}", flush=True)
                runs.setdefault((engine_name, mode), []).append(result)
    rows = []
    for engine_name in engines:
        full, lora = runs[(engine_name, "full")], runs[(engine_name, "lora")]
        for mode, rs in (("full", full), ("lora", lora)):
            barrier = lambda r: r["extract_s"] + r["push_s"] + r["check_s"]  # what the barrier waits for
            total = [barrier(r) for r in rs]
            ratio = [barrier(a) / barrier(b) for a, b in zip(rs, full)]
            rows.append({
                "engine": engine_name, "mode": mode, "bytes": rs[0]["bytes"], "tensors": rs[0]["tensors"],
                "bytes_vs_full": round(rs[0]["bytes"] / full[0]["bytes"], 4),
                "push_s": round(statistics.median(r["push_s"] for r in rs), 4),
                "check_s": round(statistics.median(r["check_s"] for r in rs), 4),
                "push_check_s": round(statistics.median(total), 4),
                "push_check_s_min": round(min(total), 4), "push_check_s_max": round(max(total), 4),
                "push_check_vs_full": round(statistics.median(ratio), 3),
                "push_check_vs_full_min": round(min(ratio), 3), "push_check_vs_full_max": round(max(ratio), 3),
                "extract_s": round(statistics.median(r["extract_s"] for r in rs), 4),
                "gen_tok_s": statistics.median(r["gen_tok_s"] for r in rs),
                "gen_vs_full": round(statistics.median(a["gen_tok_s"] / b["gen_tok_s"] for a, b in zip(rs, full)), 3),
                "max_gap": max(r["max_gap"] for r in rs), "rounds": len(rs),
                "versions_per_round": rs[0]["versions"], "model": Path(path).name, "lora_rank": LORA["rank"]})
    return rows


def trimodel_rounds(rounds: int, path: str, shape: tuple[int, int, int, int] = (2, 4, 128, 64)) -> list[dict]:
    """Tri-model bytes and micro-step time, LoRA against full, interleaved in this process."""
    sys.path.insert(0, str(HERE))
    from trimodel_cost import make_micro_batch

    from periodic_async import grpo
    from periodic_async.config import AlgorithmConfig
    from periodic_async.model import load_policy, num_parameters
    from periodic_async.trimodel import TriModel

    torch.set_num_threads(1)
    models = {mode: load_policy(_model_cfg(path, mode == "lora"))[0] for mode in ("full", "lora")}
    one = num_parameters(models["full"]) * 4
    inputs = make_micro_batch(models["full"].config.vocab_size, *shape).build(shared=True)
    variants = {"all_kept": (0.04, False, 2), "default": (0.0, True, 1)}  # beta, skip_old_forward, steps
    tris = {(mode, v): TriModel(models[mode], AlgorithmConfig(group_size=4, beta=b, skip_old_forward=s,
                                                              optimizer_steps_per_iteration=k))
            for mode in models for v, (b, s, k) in variants.items()}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in tris}
    for rnd in range(rounds + 1):
        order = list(tris)
        random.Random(rnd).shuffle(order)
        for key in order:
            models[key[0]].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            tris[key].micro_step(inputs, grpo.LossAccumulator("token-mean"))
            if rnd > 0:  # round 0 warms up
                times[key].append(time.perf_counter() - t0)
        print(f"[lora] tri-model round {rnd}/{rounds}", flush=True)
    rows = []
    for (mode, v), ts in times.items():
        full = times[("full", v)]
        mem = tris[(mode, v)].memory()
        rows.append({"mode": mode, "variant": v, **mem, "weights_vs_one_model": round(mem["total_bytes"] / one, 3),
                     "micro_step_s": round(statistics.median(ts), 4), "micro_step_s_min": round(min(ts), 4),
                     "micro_step_s_max": round(max(ts), 4),
                     "micro_step_vs_full": round(statistics.median(t / f for t, f in zip(ts, full)), 3),
                     "packed_tokens": inputs.packed.num_tokens, "rounds": len(ts), "model": Path(path).name,
                     "lora_rank": LORA["rank"]})
    return rows


ITERATION = ["algorithm.prompts_per_iteration=8", "trainer.iterations=2"]
"""async_speedup_real.yaml (one vLLM worker on one core, the trainer on the other) at B=8: one
measured iteration per run (the first is start-up)."""
ITERATION_MODES = {"sync-separated": ["algorithm.micro_batch_tokens=4096"], "periodic-async": []}
"""Each mode's best setting, as async_speedup.py's real-model setting: the synchronous mode trains
the whole batch in large micro-batches, periodic-async one group at a time."""


def iteration_rounds(rounds: int, quick: bool, runs: Path) -> list[dict]:
    """Sync-separated and periodic-async, full fine-tuning and LoRA (merged push: vLLM's CPU build
    samples through an adapter far slower than without, gen_tok_s in lora_push.csv), interleaved
    round by round (bench.protocol.measure): tokens/s, phase times and the trainer's peak memory."""
    from periodic_async.bench.protocol import SharedEngines, System, measure
    from periodic_async.config import RunConfig, load_config
    from periodic_async.engine.ray_cluster import init_ray
    from periodic_async.pipeline import run

    config = HERE / "async_speedup_real.yaml"
    quick_o = ["algorithm.prompts_per_iteration=2", "algorithm.group_size=2", "engine.max_tokens=8",
               "data.num_train=100"] if quick else []
    engines, systems = SharedEngines(), []
    for variant in ("full", "lora"):
        for mode, own in ITERATION_MODES.items():
            cfg = load_config(RunConfig, config, ITERATION + quick_o + own + (LEARNING if variant == "lora" else [])
                              + [f"pipeline.mode={mode}", f"trainer.output_dir={runs}/iteration/{variant}-{mode}"])
            systems.append(System(f"{variant}/{mode}", (lambda c: lambda: run(c, engine=engines.get(c)))(cfg), cfg))
    init_ray(systems[0].settings.engine)
    try:
        res = measure(systems, repeats=rounds, ignore_settings=("trainer.output_dir",))
    finally:
        engines.close()
    rows = []
    for name, r in res.items():
        variant, mode = name.split("/")
        same_variant_sync, same_mode_full = res[f"{variant}/sync-separated"], res[f"full/{mode}"]
        rows.append({"mode": mode, "variant": variant, **r.row(["tokens_per_s"], 1),
                     **{k: round(r.stats(k).median, 3) for k in ("mean_iteration_s", "mean_generate_s",
                                                                 "mean_train_s", "mean_sync_s")},
                     "speedup_vs_sync_separated": round(r.ratio(same_variant_sync).median, 3),
                     "tokens_per_s_vs_full": round(r.ratio(same_mode_full).median, 3),
                     "tokens_per_s_vs_full_min": round(r.ratio(same_mode_full).min, 3),
                     "tokens_per_s_vs_full_max": round(r.ratio(same_mode_full).max, 3),
                     "measured_iterations": r.measured_iterations, **r.provenance()})
    return rows


def peak_one(mode: str, path: str) -> dict:
    """One process: load the policy (full or LoRA), run one tri-model micro-step (every model kept:
    beta > 0, the old policy's forward) and one optimizer step; its peak resident memory."""
    sys.path.insert(0, str(HERE))
    from trimodel_cost import make_micro_batch

    from periodic_async import grpo
    from periodic_async.config import AlgorithmConfig
    from periodic_async.model import load_policy
    from periodic_async.trimodel import TriModel

    torch.set_num_threads(1)
    policy = load_policy(_model_cfg(path, mode == "lora"))[0]
    tri = TriModel(policy, AlgorithmConfig(group_size=4, beta=0.04, skip_old_forward=False))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6)
    inputs = make_micro_batch(policy.config.vocab_size, 2, 4, 128, 64).build(shared=True)
    tri.micro_step(inputs, grpo.LossAccumulator("token-mean"))
    opt.step()
    # VmHWM: this process's own high-water mark (getrusage's ru_maxrss survives exec on Linux: it
    # would report the parent's resident set at the fork when that was larger)
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return {"peak_rss_mib": round(int(hwm.split()[1]) / 1024, 1)}


LEARNING_LRS = (3e-5, 1e-4, 3e-4)
"""The LoRA learning rates of the sweep: 3x to 30x full fine-tuning's 1e-5 (reward_curves_real.yaml)."""
LEARNING = ["model.lora.enabled=true", "model.lora.push=merged", f"model.lora.rank={LORA['rank']}",
            f"model.lora.alpha={LORA['alpha']}"]
"""LoRA on the full fine-tuning curve's workload; the merged push, because vLLM's CPU build samples
far slower through an adapter than without (gen_tok_s in lora_push.csv); the samples are the same."""


def learning(args, final: bool = True) -> list[dict]:
    """LoRA on reward_curves_real.yaml's workload, periodic-async. The sweep (without --lr):
    `trainer.iterations` = args.sweep_iterations at each of LEARNING_LRS (constant after one
    warm-up step), then greedy accuracy on a validation draw (data.seed=1: other training prompts
    and other evaluation problems than the final run's data.seed=0, though a small problem space
    may share some); the lr with the highest validation accuracy wins. Batch accuracy cannot rank
    a few iterations: full fine-tuning's stays flat over its first five (reward_curves_real.csv)
    while its held-out accuracy rises. With --lr the sweep is skipped (chosen_by: given). The
    final run: that lr on the full curve's settings (20 iterations, cosine, held-out accuracy every
    5), by reward_curves.py, which writes reward_curves_real_lora{,_summary}.csv. Returns the
    sweep's rows and the final's; with `final` False (--parts sweep) the sweep's alone."""
    from periodic_async.bench.protocol import SharedEngines
    from periodic_async.config import RunConfig, load_config
    from periodic_async.pipeline import run
    from periodic_async.trace import read_jsonl

    config = HERE / "reward_curves_real.yaml"
    runs = Path(args.runs) / "lora_learning"
    quick = ["data.num_train=200", "algorithm.prompts_per_iteration=2", "algorithm.group_size=2",
             "engine.max_tokens=8"] if args.quick else []
    rows, engines = [], SharedEngines()
    try:
        for lr in [] if args.lr else LEARNING_LRS[:1] if args.quick else LEARNING_LRS:
            cfg = load_config(RunConfig, config, LEARNING + quick + [
                f"algorithm.lr={lr}", "algorithm.lr_scheduler=constant", "algorithm.warmup_steps=1",
                f"trainer.iterations={args.sweep_iterations}", "data.seed=1",
                f"data.num_eval={2 if args.quick else args.sweep_eval}", "trainer.eval_every=0",
                "trainer.eval_at_end=true", f"trainer.output_dir={runs}/sweep-lr{lr:g}"])
            run(cfg, engine=engines.get(cfg))
            out = Path(cfg.trainer.output_dir)
            acc = [m["accuracy"] for m in read_jsonl(out / "metrics.jsonl") if "accuracy" in m]
            val = read_jsonl(out / "eval.jsonl")[-1]
            rows.append({"kind": "sweep", "lr": lr, "iterations": len(acc), "chosen_by": "validation accuracy",
                         "validation_accuracy": round(val["accuracy"], 4), "validation_n": val["n"],
                         "batch_accuracy": round(statistics.mean(acc), 4)})
            print(f"[lora] learning sweep lr={lr:g}: batch accuracy {[round(a, 3) for a in acc]}, "
                  f"validation {val['accuracy']:.3f}", flush=True)
    finally:
        engines.close()
    if not final:
        return rows
    best = (max(rows, key=lambda r: r["validation_accuracy"]) if rows else
            {"lr": args.lr, "chosen_by": "given (--lr)"})
    best["chosen"] = True
    sys.path.insert(0, str(HERE))
    import reward_curves

    final_quick = (["--quick", *quick, "trainer.iterations=2", "trainer.eval_every=2", "data.num_eval=2"]
                   if args.quick else [])
    reward_curves.main(["--config", str(config), "--tag", "real_lora", "--modes", "periodic-async",
                        "--results", args.results, "--runs", str(runs), *final_quick, *LEARNING,
                        f"algorithm.lr={best['lr']}"])
    from periodic_async.records import read_csv

    final = read_csv(Path(args.results) / "reward_curves_real_lora_summary.csv")[0]
    iterations = 2 if args.quick else load_config(RunConfig, config, []).trainer.iterations
    rows.append({"kind": "final", "lr": best["lr"], "chosen_by": best["chosen_by"], "iterations": iterations,
                 **{k: final[k] for k in ("eval_accuracy_start", "eval_accuracy_end", "eval_n", "gain", "gain_stderr",
                                          "gain_stderr_paired", "wall_s")}})
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "peak-one":
        print(json.dumps(peak_one(sys.argv[2], sys.argv[3])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "push-one":
        engine_name, mode, versions, path = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
        print(json.dumps(push_one(engine_name, mode, versions, path)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--versions", type=int, default=6, help="pushes per process (the first is not counted)")
    ap.add_argument("--engines", default="local,vllm")
    ap.add_argument("--quick", action="store_true", help="1 round, 2 versions, vLLM only, a small micro-batch")
    ap.add_argument("--results", default="results")
    ap.add_argument("--runs", default="runs/lora")
    ap.add_argument("--parts", default="trimodel,push,iteration,learning",
                    help="comma-separated: trimodel, push, iteration, learning (the sweep, unless --lr, then the "
                    "final run: about 1.5 hours), sweep (the sweep alone; an earlier final run's rows are kept)")
    ap.add_argument("--sweep-iterations", type=int, default=4, help="iterations of each learning-rate sweep run")
    ap.add_argument("--sweep-eval", type=int, default=100, help="validation problems of each sweep run")
    ap.add_argument("--lr", type=float, default=None, help="the LoRA learning rate of the learning run (no sweep)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"trimodel", "push", "iteration", "learning", "sweep"}:
        ap.error(f"--parts {args.parts}: expected trimodel, push, iteration, learning, sweep")
    if "sweep" in parts and ("learning" in parts or args.lr):
        ap.error("--parts sweep runs the learning-rate sweep alone (learning runs it before its final run)")
    if args.quick:  # the same code paths, small: vLLM only, a small micro-batch
        args.rounds, args.versions, args.engines = 1, 2, "vllm"
    from periodic_async.records import write_csv
    from periodic_async.trace import log_experiment

    out, written = Path(args.results), []
    if "trimodel" in parts:
        tri = (trimodel_rounds(1, args.model, (1, 2, 32, 16)) if args.quick
               else trimodel_rounds(max(args.rounds, 3), args.model))
        peaks: dict[str, list[float]] = {"full": [], "lora": []}
        for rnd in range(1 if args.quick else max(args.rounds, 3)):
            for mode in ("full", "lora") if rnd % 2 == 0 else ("lora", "full"):
                r = subprocess.run([sys.executable, __file__, "peak-one", mode, args.model], capture_output=True,
                                   text=True)
                if r.returncode != 0:
                    sys.exit(f"lora.py: peak memory of {mode} failed:\n{r.stderr[-3000:]}")
                peaks[mode].append(json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mib"])
        for row in tri:
            if row["variant"] == "all_kept":  # the process that trains with every model kept
                row["peak_rss_mib"] = statistics.median(peaks[row["mode"]])
                row["peak_rss_vs_full"] = round(row["peak_rss_mib"] / statistics.median(peaks["full"]), 3)
        written.append(write_csv(out / "lora_trimodel.csv", tri))
        for r in tri:
            print(f"{r['mode']:5s} {r['variant']:9s} weights x{r['weights_vs_one_model']:.3f} one model, "
                  f"micro-step {r['micro_step_s']:.3f} s (x{r['micro_step_vs_full']:.2f} full)")
    if "push" in parts:
        push = push_rounds(args.engines.split(","), args.rounds, args.versions, args.model)
        written.append(write_csv(out / "lora_push.csv", push))
        for r in push:
            print(f"{r['engine']:6s} {r['mode']:5s} {r['bytes'] / 2**20:7.1f} MiB  push+check "
                  f"{r['push_check_s']:.3f} s (x{r['push_check_vs_full']:.2f} full)")
    if "iteration" in parts:
        rows = iteration_rounds(1 if args.quick else args.rounds, args.quick, Path(args.runs))
        written.append(write_csv(out / "lora_iteration.csv", rows))
        for r in rows:
            print(f"{r['variant']:5s} {r['mode']:15s} {r['tokens_per_s']:7.1f} tokens/s "
                  f"(x{r['speedup_vs_sync_separated']:.2f} sync-separated, x{r['tokens_per_s_vs_full']:.2f} full)")
    if "learning" in parts:
        rows = learning(args)
        written.append(write_csv(out / "lora_learning.csv", rows))
        print(f"[lora] learning: {rows[-1]}")
    if "sweep" in parts:  # the sweep's rows replace an earlier sweep's; the final run's rows stay as they were
        from periodic_async.records import read_csv

        old = out / "lora_learning.csv"
        kept = [r for r in (read_csv(old) if old.is_file() else []) if r["kind"] == "final"]
        rows = learning(args, final=False)
        best = max(rows, key=lambda r: r["validation_accuracy"])
        best["chosen"] = True
        written.append(write_csv(old, rows + kept))
        print(f"[lora] sweep: lr {best['lr']:g} has the best validation accuracy ({best['validation_accuracy']})")
    log_experiment("lora", written)


if __name__ == "__main__":
    main()
