"""Command line: `python -m periodic_async {train,sft,eval,plan,prepare-model,tokenizer} ...`.

    python -m periodic_async train --config experiments/async_speedup.yaml pipeline.mode=sync-separated
    python -m periodic_async sft --config experiments/sft.yaml
    python -m periodic_async eval --config runs/x/config.yaml eval.checkpoint=runs/x eval.max_tokens=256
    python -m periodic_async plan --model-params 32e9 --devices 64 --batch 512 --group 16   (simulated; scale/plan.py)
    python -m periodic_async prepare-model smollm2-135m   (SmolLM2-135M-Instruct -> artifacts/; prepare.py)
    python -m periodic_async tokenizer artifacts/tokenizer   (the tiny presets' offline tokenizer; data/tokenizer.py)

A mistake in what the user gave (config, data, reward code, a missing path: `UserError` or
FileNotFoundError) prints one line to stderr and exits non-zero (2 for config errors, 1
otherwise); `--debug` or PERIODIC_ASYNC_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _log_to_stderr() -> None:
    """The package's INFO lines (each weight push and its check: engine/verify.py) on stderr."""
    log = logging.getLogger("periodic_async")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


COMMANDS = """commands:
  train          GRPO RL in any mode (pipeline.mode): --config file.yaml section.key=value ...
  sft            supervised fine-tuning (the warm start of the RL base policy)
  eval           held-out greedy accuracy (+ standard error, per task) of a run's checkpoint (eval.checkpoint=...)
  plan           simulated device split and throughput for a model size (plan --help for its options)
  prepare-model  write a packaged model as a Hugging Face directory (prepare-model smollm2-135m)
  tokenizer      build the tiny presets' offline tokenizer (tokenizer artifacts/tokenizer)

examples:
  python -m periodic_async tokenizer artifacts/tokenizer
  python -m periodic_async train --config experiments/async_speedup.yaml model.name_or_path=qwen2-1m
  python -m periodic_async plan --model-params 32e9 --devices 64 --batch 512 --group 16"""
"""The epilog of `--help`: every subcommand, including those with parsers of their own."""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # the device-split planner has its own options (periodic_async/scale/plan.py)
        from periodic_async.scale.plan import main as plan

        plan(argv[1:])
        return
    if argv[:1] == ["prepare-model"]:  # a packaged model as a HF directory (periodic_async/prepare.py)
        from periodic_async.prepare import main as prepare_model

        prepare_model(argv[1:])
        return
    if argv[:1] == ["tokenizer"]:  # build the offline BPE tokenizer of the tiny presets (data/tokenizer.py)
        from periodic_async.data.tokenizer import main as tokenizer

        tokenizer(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m periodic_async", description=__doc__.split("\n\n")[0],
                                     epilog=COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train", "sft", "eval"], metavar="command",
                        help="train, sft or eval (every command is listed below)")
    parser.add_argument("--config", default=None, help="YAML config (see experiments/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--debug", action="store_true",
                        help="full traceback on errors in the input (also PERIODIC_ASYNC_DEBUG=1)")
    args = parser.parse_intermixed_args(argv)
    debug = args.debug or os.environ.get("PERIODIC_ASYNC_DEBUG", "") not in ("", "0")
    from periodic_async.config import ConfigError, EvalRunConfig, RunConfig, SFTRunConfig, UserError, load_config
    from periodic_async.interrupt import Interrupted, install

    install()  # SIGINT / SIGTERM stop the run cleanly (checkpoint saved, engines and Ray closed)
    _log_to_stderr()
    try:
        if args.command == "train":
            cfg = load_config(RunConfig, args.config, args.overrides)  # before the heavy imports: fails fast
            from periodic_async.pipeline import run

            summary = run(cfg)
        elif args.command == "sft":
            cfg = load_config(SFTRunConfig, args.config, args.overrides)
            from periodic_async.sft import run_sft

            summary = run_sft(cfg)
        else:  # a run's config, a warm start's, or none; eval.* on top
            cfg = load_config(EvalRunConfig, args.config, args.overrides)
            from periodic_async.evaluate import run_eval

            summary = run_eval(cfg)
    except (UserError, FileNotFoundError) as e:  # the user's input: one line, no traceback
        if debug:
            raise
        what = "config error" if isinstance(e, ConfigError) else "error"
        message = " | ".join(line.strip() for line in str(e).splitlines() if line.strip())
        parser.exit(2 if isinstance(e, ConfigError) else 1,
                    f"{args.command}: {what}: {message} (--debug for the traceback)\n")
    except Interrupted as e:  # what was started is released; the last completed iteration is saved
        parser.exit(e.exit_code, f"{args.command}: {e}\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
