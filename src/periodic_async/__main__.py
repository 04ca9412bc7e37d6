"""Command line: `python -m periodic_async {train,sft,eval} ...`.

    python -m periodic_async train --config experiments/async_speedup.yaml pipeline.mode=sync-separated
    python -m periodic_async sft --config experiments/sft.yaml
    python -m periodic_async eval --config experiments/sft.yaml model.name_or_path=runs/x/checkpoint
    python -m periodic_async plan --model-params 32e9 --devices 64 --batch 512 --group 16   (simulated; plan.py)
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # the device-split planner has its own options (periodic_async/plan.py)
        from periodic_async.plan import main as plan

        plan(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m periodic_async", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["train", "sft", "eval"])
    parser.add_argument("--config", default=None, help="YAML config (see experiments/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_intermixed_args(argv)
    from periodic_async.config import ConfigError, RunConfig, SFTRunConfig, load_config
    from periodic_async.interrupt import Interrupted, install

    install()  # SIGINT / SIGTERM stop the run cleanly (checkpoint saved, engines and Ray closed)
    try:
        if args.command == "train":
            from periodic_async.pipeline import run

            summary = run(load_config(RunConfig, args.config, args.overrides))
        elif args.command == "sft":
            from periodic_async.sft import run_sft

            summary = run_sft(load_config(SFTRunConfig, args.config, args.overrides))
        else:
            from periodic_async.data import few_shot_examples, load_examples
            from periodic_async.evaluate import evaluate
            from periodic_async.model import load_policy

            cfg = load_config(SFTRunConfig, args.config, args.overrides)
            model, tok = load_policy(cfg.model)
            r = evaluate(model, tok, load_examples(cfg.data, "eval"), few_shot_examples(cfg.data))
            summary = {k: v for k, v in r.items() if k != "samples"}
    except ConfigError as e:
        parser.exit(2, f"config error: {e}\n")
    except Interrupted as e:  # what was started is released; the last completed iteration is saved
        parser.exit(e.exit_code, f"{args.command}: {e}\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
