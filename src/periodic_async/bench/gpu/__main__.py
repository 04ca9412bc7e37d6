"""First light on a GPU, one step a process: `python -m periodic_async.bench.gpu STEP --out OUT`.

The steps and what they write: the package docstring (periodic_async/bench/gpu/__init__.py). A
process imports the one step it runs (its module, by name), so that its import report (the last
line it prints) shows what that step needs.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import get_args

import torch

from periodic_async.bench.gpu import preflight
from periodic_async.bench.gpu.common import FULL, TOY, Budget, Table, gpu_spec, provenance
from periodic_async.bench.gpu.preflight import STEPS
from periodic_async.config import AttentionBackend


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m periodic_async.bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=("preflight", *STEPS))
    ap.add_argument("--out", type=Path, required=True, help="the CSVs go here (<step>.csv)")
    ap.add_argument("--work", type=Path, default=None, help="tokenizer and run directories (default OUT/.work)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--toy", action="store_true", help="toy sizes: the same code in seconds on a CPU")
    ap.add_argument("--budget-s", type=float, default=600.0, help="this step's deadline; what does not fit is skipped")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: GPU_SPECS by name)")
    ap.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth (default: GPU_SPECS by name)")
    ap.add_argument("--trainer-backend", default="split", choices=get_args(AttentionBackend),
                    help="attention back-end of the trainer step (the attention step compares them)")
    args = ap.parse_args(argv)
    args.work = args.work or args.out / ".work"
    if args.device.startswith("cuda") and torch.cuda.is_available():
        tflops, hbm = gpu_spec(torch.cuda.get_device_name(torch.device(args.device)))
        args.peak_tflops = args.peak_tflops or tflops
        args.hbm_gbps = args.hbm_gbps or hbm
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.step == "preflight":
        return preflight.step(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible: nothing measured", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = TOY if args.toy else FULL
    budget = Budget(args.budget_s)
    prov = provenance(device)
    table = Table(args.out / f"{args.step}.csv", {**prov, "toy": args.toy,
                                                  "hbm_gbps": args.hbm_gbps or ""})
    t = time.perf_counter()
    importlib.import_module(f"periodic_async.bench.gpu.{args.step}").step(args, sizes, device, budget, table)
    bad = table.failed
    print(f"gpu_check {args.step}: {len(table.rows)} rows, {len(bad)} failed, {time.perf_counter() - t:.1f}s "
          f"-> {table.path}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    atexit.register(preflight.report_imports)  # the log says what this process imported (gpu_wheels.sh's list)
    sys.exit(main())
