"""A discrete-event simulation of one iteration of the three on-policy modes (every number it
gives is *simulated*: label it so wherever it is shown).

What it models (the paper's Figure 1 and its Section 3 deployment): B prompts x G responses
per iteration; inference engines with continuous batching (`slots` sequences each, FIFO
admission, the prompt prefilled once per group); a trainer that packs groups into
micro-batches (the token budget of `batching.MicroBatcher`, ported) and takes one optimizer
step per iteration; then the weight-sync barrier.

    sync-colocated   all devices generate (as engines), then all devices train; + switch cost
    sync-separated   engines on `inference_devices`, trainer on `train_devices`; training
                     starts when the last group is done, in dataset order
    periodic-async   same split; the trainer takes groups in completion order as they finish:
                     iteration = max(gen, first group + train) + tail + sync, where the tail
                     is the training left when generation ends

The ordering effects it keeps: the longest response of a group holds the group (a group is
done when its last sample is), the trainer waits for the first group (or the first full
micro-batch), starves between completions, and has a tail after generation ends.

Costs (`Costs`, seconds, from `calibrate.py`: fitted on runs of this repository, or derived
from a device file), per engine of `devices_per_engine` devices:
    decode step with n active sequences   a + b*n + c*(sum of their context lengths)
    prefill                               p * prompt tokens, once per group (at admission)
    micro-step                            (train_token_s * packed tokens + train_micro_step_s) / speedup
    optimizer step                        optimizer_step_s / speedup
    speedup(D trainer devices)            (D/D0) * dp_efficiency ** log2(D/D0), D0 = train_ref_devices
    weight sync                           sync_base_s + sync_per_byte_s * model_bytes

Assumptions, stated: a sample of R tokens decodes for R-1 steps (its first token comes from
the prefill logits, as in engine/batcher.py); requests go to engines round-robin (what
`assign_workers` does when every request asks for the same n and max_tokens); reward
scoring, queueing and logging take no time; on accelerators every worker owns its devices.
On a CPU host (`host_cores` set) the busy workers share the cores (processor sharing: each
runs at min(1, cores / busy threads)) and slow each other by `contention` per other busy
worker (memory bandwidth): this is what two phases overlapping on one 2-core machine cost.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence, get_args

import numpy as np

from periodic_async.config import OnPolicyMode


@dataclass(frozen=True)
class Costs:
    """Cost parameters in seconds (see the module docstring for where each enters)."""

    decode_step_s: float
    """a: one decode step of one engine, whatever the number of sequences (weight reads)."""
    decode_seq_s: float
    """b: per active sequence per decode step."""
    prefill_token_s: float
    """p: per prompt token, once per group."""
    train_token_s: float
    """Forward+backward of the tri-model per packed token, on `train_ref_devices` devices."""
    decode_ctx_s: float = 0.0
    """c: per context token (prompt + generated) of each active sequence per step (KV reads)."""
    train_micro_step_s: float = 0.0
    """Fixed cost of one micro-step on `train_ref_devices`."""
    optimizer_step_s: float = 0.0
    """The optimizer step (clip, AdamW) on `train_ref_devices`."""
    train_ref_devices: int = 1
    """D0: the trainer size the train costs refer to (the smallest that holds the model)."""
    dp_efficiency: float = 1.0
    """Fraction of linear data-parallel speedup kept per doubling of trainer devices."""
    sync_base_s: float = 0.0
    """Latency of the barrier's weight push."""
    sync_per_byte_s: float = 0.0
    """Seconds per byte of the model's (engine-dtype) weights pushed."""
    colocate_switch_s: float = 0.0
    """sync-colocated only: both switches between generating and training per iteration
    (release / reload weights, optimizer state and KV cache); 0 on a CPU."""
    devices_per_engine: int = 1
    """Devices one engine occupies (tensor parallel size; threads per worker on a CPU)."""
    host_cores: float | None = None
    """CPU host: the cores every worker shares; None: each worker owns its devices."""
    contention: float = 0.0
    """CPU host: each busy worker slows by this fraction per other busy worker."""

    def train_speedup(self, devices: int) -> float:
        """Data-parallel speedup of `devices` trainer devices over `train_ref_devices`."""
        r = devices / self.train_ref_devices
        return r * self.dp_efficiency ** math.log2(r) if r > 0 else 0.0

    def sync_s(self, model_bytes: float) -> float:
        return self.sync_base_s + self.sync_per_byte_s * model_bytes


@dataclass(frozen=True)
class Workload:
    """One iteration's shape: `prompts` x `group_size` samples, the micro-batching, the model size."""

    prompts: int
    group_size: int
    slots: int
    """Sequences decoded together per engine (max_num_seqs)."""
    micro_batch_tokens: int = 0
    """Packed-token budget of a micro-batch (0: `micro_batch_groups` whole groups)."""
    micro_batch_groups: int = 1
    shared_prompt: bool = True
    model_bytes: float = 0.0
    """Bytes of the weights the barrier pushes."""


@dataclass(frozen=True)
class Deployment:
    mode: OnPolicyMode
    inference_devices: int
    """Devices of the engines (sync-colocated: all the devices, which also train)."""
    train_devices: int
    """Devices of the trainer (sync-colocated: the same devices as inference)."""

    @property
    def devices(self) -> int:
        if self.mode == "sync-colocated":
            return max(self.inference_devices, self.train_devices)
        return self.inference_devices + self.train_devices


@dataclass(frozen=True)
class IterationResult:
    """One simulated iteration; times in seconds from its start."""

    mode: str
    devices: int
    iteration_s: float
    generate_s: float
    """When the last group is done."""
    first_group_s: float
    train_busy_s: float
    """Wall time the trainer spent in micro-steps and the optimizer step."""
    train_end_s: float
    sync_s: float
    trained_tokens: int
    """sum over samples of (P + R_i)."""

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.iteration_s

    @property
    def after_generation_s(self) -> float:
        return self.train_end_s - self.generate_s


# --- an engine in step space ------------------------------------------------------------

@dataclass(frozen=True)
class Chunk:
    """`steps` decode steps with `n` sequences active (none finishes before the last), after
    admitting prompts of `prefill_tokens`. ctx_sum: sum over the steps of the active
    sequences' context lengths. finished: the group index of every sample done at its end."""

    prefill_tokens: int
    steps: int
    n: int
    ctx_sum: float
    finished: tuple[int, ...]

    def features(self) -> np.ndarray:
        """Coefficients of (a, b, c, p): its time is features() @ (a, b, c, p)."""
        return np.array([self.steps, self.steps * self.n, self.ctx_sum, self.prefill_tokens], dtype=float)

    def seconds(self, c: Costs) -> float:
        return float(self.features() @ np.array([c.decode_step_s, c.decode_seq_s, c.decode_ctx_s,
                                                 c.prefill_token_s]))


def engine_chunks(samples: Sequence[tuple[int, int, int]], slots: int) -> Iterator[Chunk]:
    """The schedule of one engine, in step space (cost-free, so calibration can fit it).

    samples: (group index, prompt tokens P, response tokens R) in submission order; FIFO
    admission into `slots`; a group's prompt is prefilled when its first sample is admitted;
    a sample holds its slot for R-1 decode steps (a sample with R = 1 is done at admission)."""
    waiting = deque(samples)
    prefilled: set[int] = set()
    active: list[tuple[int, int, int, int]] = []  # heap of (finish step, seq id, group, P - admit step)
    step, ctx0, seq = 0, 0, 0  # the active sequences' context sum at `step` is ctx0 + len(active) * step
    while waiting or active:
        prefill, finished = 0, []
        while waiting and len(active) < slots:
            g, p, r = waiting.popleft()
            if g not in prefilled:
                prefilled.add(g)
                prefill += p
            if r <= 1:
                finished.append(g)
                continue
            heapq.heappush(active, (step + r - 1, seq, g, p - step))
            seq += 1
            ctx0 += p - step
        n = len(active)
        if n == 0:
            yield Chunk(prefill, 0, 0, 0.0, tuple(finished))
            continue
        k = active[0][0] - step
        ctx_sum = k * ctx0 + n * (k * step + k * (k - 1) / 2)
        step += k
        while active and active[0][0] == step:
            _, _, g, offset = heapq.heappop(active)
            finished.append(g)
            ctx0 -= offset
        yield Chunk(prefill, k, n, ctx_sum, tuple(finished))


# --- the trainer's micro-batches -----------------------------------------------------------

class MicroBatches:
    """`batching.MicroBatcher` on token counts: `add(P, lengths)` returns the packed tokens of
    the micro-batches the group completes; `flush()` the last, partial one."""

    def __init__(self, max_tokens: int, groups: int = 1, shared: bool = True) -> None:
        self.max_tokens, self.groups, self.shared = max_tokens, groups, shared
        self.tokens, self.open_groups = 0, 0

    def add(self, p: int, lengths: Sequence[int]) -> list[int]:
        out = []
        if self.max_tokens == 0:
            self.tokens += (p if self.shared else len(lengths) * p) + sum(lengths)
            self.open_groups += 1
            if self.open_groups >= self.groups:
                out.append(self.tokens)
                self.tokens, self.open_groups = 0, 0
            return out
        current = 0  # samples of this group in the open micro-batch
        for r in lengths:
            cost = r + (0 if (current and self.shared) else p)
            if (self.tokens or current) and self.tokens + cost > self.max_tokens:
                out.append(self.tokens)
                self.tokens, current, cost = 0, 0, r + p
            current += 1
            self.tokens += cost
            if self.tokens >= self.max_tokens:
                out.append(self.tokens)
                self.tokens, current = 0, 0
        return out

    def flush(self) -> list[int]:
        out = [self.tokens] if self.tokens else []
        self.tokens, self.open_groups = 0, 0
        return out


# --- the iteration -------------------------------------------------------------------------

class _Worker:
    """A worker in the event loop: `work` seconds (at full speed) left on its current job."""

    def __init__(self, threads: float) -> None:
        self.threads, self.work, self.job, self.started = threads, None, None, 0.0


def simulate_iteration(lengths_BxG: Sequence[Sequence[int]], prompt_tokens_B: Sequence[int], workload: Workload,
                       deployment: Deployment, costs: Costs) -> IterationResult:
    """Simulate one iteration of `deployment.mode` (see the module docstring).

    lengths_BxG: response tokens R of every sample, prompts in dataset order; prompt_tokens_B:
    P of each prompt. Returns the simulated `IterationResult`."""
    mode, w, c = deployment.mode, workload, costs
    if mode not in get_args(OnPolicyMode):
        raise ValueError(f"mode={mode!r}: expected one of {get_args(OnPolicyMode)}")
    B = len(lengths_BxG)
    colocated = mode == "sync-colocated"
    infer = deployment.devices if colocated else deployment.inference_devices
    train_devices = deployment.devices if colocated else deployment.train_devices
    n_engines = infer // c.devices_per_engine
    if n_engines < 1 or train_devices < c.train_ref_devices:
        raise ValueError(f"{deployment}: needs >= {c.devices_per_engine} inference and >= "
                         f"{c.train_ref_devices} training devices")
    speedup = c.train_speedup(train_devices)
    per_engine: list[list[tuple[int, int, int]]] = [[] for _ in range(n_engines)]
    for g in range(B):  # round-robin dispatch at submit time
        per_engine[g % n_engines] += [(g, int(prompt_tokens_B[g]), int(r)) for r in lengths_BxG[g]]
    schedules = [engine_chunks(s, w.slots) for s in per_engine]
    engines = [_Worker(c.devices_per_engine) for _ in range(n_engines)]
    trainer = _Worker(train_devices)
    left = [len(lengths_BxG[g]) for g in range(B)]
    done_at: dict[int, float] = {}
    arrived: list[int] = []  # groups handed to the trainer, in the order it takes them
    batcher = MicroBatches(w.micro_batch_tokens, w.micro_batch_groups, w.shared_prompt)
    jobs: deque[tuple[str, float]] = deque()  # the trainer's ready work: (kind, seconds at full speed)
    streaming = mode == "periodic-async"
    now, busy_s, last_job_end = 0.0, 0.0, 0.0

    def next_chunk(e: int) -> None:
        chunk = next(schedules[e], None)
        engines[e].job = chunk
        engines[e].work = None if chunk is None else chunk.seconds(c)

    def hand_over(groups: list[int]) -> None:
        for g in groups:
            arrived.append(g)
            for tokens in batcher.add(int(prompt_tokens_B[g]), lengths_BxG[g]):
                jobs.append(("micro", (c.train_token_s * tokens + c.train_micro_step_s) / speedup))
        if len(arrived) == B:
            jobs.extend(("micro", (c.train_token_s * t + c.train_micro_step_s) / speedup) for t in batcher.flush())
            jobs.append(("step", c.optimizer_step_s / speedup))

    for e in range(n_engines):
        next_chunk(e)
    while True:
        if trainer.work is None and jobs:
            trainer.job, trainer.work = jobs.popleft()
            trainer.started = now
        busy = [x for x in engines + [trainer] if x.work is not None]
        if not busy:
            break
        demand = sum(x.threads for x in busy)
        rate = min(1.0, c.host_cores / demand) if c.host_cores else 1.0
        rate /= 1.0 + c.contention * (len(busy) - 1)
        dt = min(x.work for x in busy) / rate
        now += dt
        for x in busy:
            x.work -= dt * rate
        for e, x in enumerate(engines):
            if x.work is not None and x.work <= 1e-9:
                done = []
                for g in x.job.finished:
                    left[g] -= 1
                    if left[g] == 0:
                        done_at[g] = now
                        done.append(g)
                if streaming:
                    hand_over(sorted(done))
                elif len(done_at) == B and not arrived:
                    hand_over(list(range(B)))  # dataset order, once the whole batch is in
                next_chunk(e)
        if trainer.work is not None and trainer.work <= 1e-9:
            busy_s += now - trainer.started
            last_job_end = now
            trainer.work = None
    if len(done_at) != B or len(arrived) != B:
        raise RuntimeError("simulation ended with groups not done")
    sync = c.sync_s(w.model_bytes) + (c.colocate_switch_s if colocated else 0.0)
    trained = sum(len(r) * p + sum(r) for r, p in zip(lengths_BxG, prompt_tokens_B))
    return IterationResult(mode, deployment.devices, last_job_end + sync, max(done_at.values()),
                           min(done_at.values()), busy_s, last_job_end, sync, int(trained))


# --- workloads and runs --------------------------------------------------------------------

@dataclass(frozen=True)
class LengthDist:
    """Response lengths: an empirical sample (drawn with replacement) or a lognormal with
    `median` and `sigma` (a long right tail), clipped to [1, max_tokens]; iid per sample."""

    max_tokens: int
    median: float = 0.0
    sigma: float = 0.0
    empirical: tuple[int, ...] = ()

    def sample(self, rng: np.random.Generator, B: int, G: int) -> list[list[int]]:
        if self.empirical:
            x = rng.choice(np.asarray(self.empirical), size=(B, G))
        else:
            x = np.rint(self.median * np.exp(self.sigma * rng.standard_normal((B, G))))
        return np.clip(x, 1, self.max_tokens).astype(int).tolist()


def simulate_run(workload: Workload, deployment: Deployment, costs: Costs, lengths: LengthDist,
                 prompt_tokens: int, iterations: int = 3, seed: int = 0) -> list[IterationResult]:
    """`iterations` independent iterations, each with fresh lengths from `lengths` (seeded):
    iterations of these modes do not overlap, so a run is their sum."""
    rng = np.random.default_rng(seed)
    return [simulate_iteration(lengths.sample(rng, workload.prompts, workload.group_size),
                               [prompt_tokens] * workload.prompts, workload, deployment, costs)
            for _ in range(iterations)]


def run_tokens_per_s(results: Sequence[IterationResult]) -> float:
    """Trained tokens / wall time over the iterations (simulated)."""
    return sum(r.trained_tokens for r in results) / sum(r.iteration_s for r in results)
