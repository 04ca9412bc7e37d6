"""Peak memory of a call: the most bytes its tensors held at once beyond what was allocated before.

On CUDA, the caching allocator's own statistics (`torch.cuda.max_memory_allocated`). On a CPU,
torch's profiler with `profile_memory=True`: it records every allocation and free of torch's CPU
allocator with the running total of the bytes allocated since it started, so the peak is read
from that record. Both count tensor storage only (not Python objects, not freed-but-cached
blocks), the same way on a busy machine as on an idle one: what the activation-memory tests
(tests/test_checkpointing.py, tests/test_chunked_logits.py) compare.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Runs `fn()` once; the peak of the bytes allocated during it that were still held (CUDA: on
    `device`; CPU: by torch's CPU allocator, every thread)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    cpu = [e["args"] for e in sorted(events, key=lambda e: e.get("ts", 0))
           if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0]
    if not cpu:
        return 0
    # the running total is the process's: it still counts what an earlier profiled call left allocated
    before = cpu[0]["Total Allocated"] - cpu[0]["Bytes"]
    return max(a["Total Allocated"] for a in cpu) - before
