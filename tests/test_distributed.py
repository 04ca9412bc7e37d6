"""Trainer ranks (distributed.py) on real gloo process groups, checked against one process:
uneven (and empty) shares of an iteration's groups give the single-process update (fp64), FSDP2
lays policy / old / ref out alike so that refreshing old needs no communication, checkpoints
written by 2 ranks (ddp, fsdp) are a single process's and resume in either (the uninterrupted
run's tokens and weights), and a torchrun run of `python -m periodic_async train` follows the
single-process run, held-out evaluation included. The module's tests share two rank processes
(`RankPool`): each test's rank function runs in them as torchrun's ranks would run it, without
paying their start-up again."""

import datetime
import json
import os
import queue
import random
import re
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from periodic_async import grpo
from periodic_async.config import RunConfig, load_config
from periodic_async.consumer import Consumer
from periodic_async.group import Group
from periodic_async.model import build_model
from periodic_async.data.tokenizer import load_tokenizer

from helpers import DIVERSITY_REWARD

B, G = 4, 3
PLAN = [  # which groups each rank trains, in its order, per iteration
    {0: [2, 0, 1], 1: [3]},  # uneven
    {0: [], 1: [3, 1, 0, 2]},  # rank 0 gets none
]


def _cfg(tokenizer_dir, parallel: str = "ddp", **extra) -> RunConfig:
    overrides = {"model.name_or_path": "qwen2-micro", "model.tokenizer": str(tokenizer_dir), "model.device": "cpu",
                 "model.dtype": "float64", "model.seed": 3, "algorithm.group_size": G,
                 "algorithm.prompts_per_iteration": B, "algorithm.lr": 3e-3, "algorithm.beta": 0.05,
                 "algorithm.skip_old_forward": False, "algorithm.micro_batch_tokens": 40,
                 "algorithm.attention_backend": "split", "trainer.iterations": len(PLAN),
                 "trainer.parallel": parallel, "engine.timeout_s": 30}
    overrides.update(extra)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])


def _groups(vocab: int, iteration: int) -> list[Group]:
    """B groups of G random responses of different lengths, distinct rewards, sampled by `iteration`."""
    rng = random.Random(100 + iteration)
    out = []
    for b in range(B):
        responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 9))] for _ in range(G)]
        rewards = [rng.random() for _ in range(G)]
        out.append(Group(b, iteration, iteration, [rng.randrange(4, vocab) for _ in range(rng.randint(4, 8))],
                         responses, [[-1.0] * len(r) for r in responses], rewards,
                         grpo.group_advantages(rewards).tolist()))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_ranks(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # a short timeout: a collective that one rank never joins fails the test instead of hanging it
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))


def _serve(rank: int, jobs, results) -> None:
    """A rank process of `RankPool` (killed by it): runs fn(rank, *args) for each job and reports
    (rank, None) or (rank, the traceback); leaves no process group behind a job."""
    torch.set_num_threads(1)
    while True:
        fn, args = jobs.get()
        try:
            fn(rank, *args)
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


class RankPool:
    """`world` rank processes started once for the module (spawned, as torch.multiprocessing
    starts them: each imports torch and transformers once) that run each test's rank function,
    fn(rank, *args), at the same time. A rank that raises, dies or outlives the timeout fails the
    test and the processes are killed; the next test starts new ones."""

    def __init__(self, world: int = 2):
        self.world, self.procs = world, []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.jobs, self.results = [ctx.Queue() for _ in range(self.world)], ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, self.jobs[r], self.results), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, args: tuple, timeout_s: float = 600.0) -> None:
        if not (self.procs and all(p.is_alive() for p in self.procs)):
            self.close()
            self._start()
        for q in self.jobs:
            q.put((fn, args))
        deadline, done = time.time() + timeout_s, set()
        try:
            while len(done) < self.world:
                try:
                    rank, error = self.results.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead:
                        pytest.fail(f"rank {dead[0]} died (exit code {self.procs[dead[0]].exitcode})")
                    if time.time() > deadline:
                        pytest.fail(f"ranks did not finish within {timeout_s} s (a deadlock?)")
                    continue
                if error:
                    pytest.fail(f"rank {rank} raised:\n{error}")
                done.add(rank)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.join()
        self.procs = []


@pytest.fixture(scope="module")
def rank_pool():
    pool = RankPool()
    yield pool
    pool.close()


def _train_ranks(rank: int, world: int, port: int, tokenizer_dir: str, parallel: str, out: str) -> None:
    from periodic_async.parallel.distributed import init_ranks

    _join_ranks(rank, world, port)
    cfg = _cfg(tokenizer_dir, parallel)
    ranks = init_ranks(cfg)
    policy = build_model(cfg.model, load_tokenizer(tokenizer_dir))
    consumer = Consumer(policy, cfg, ranks=ranks)
    ranks.start(consumer, 0)
    metrics = []
    for iteration, plan in enumerate(PLAN):
        groups = _groups(policy.config.vocab_size, iteration)
        metrics.append(consumer.train_iteration([groups[i] for i in plan[rank]], iteration, iteration))
    state = {k: v.clone() for k, v in ranks.full_state_dict(policy).items()}
    torch.save({"state": state, "metrics": metrics, "version": consumer.version}, Path(out) / f"rank{rank}.pt")
    ranks.close()


def _single_process(tokenizer_dir) -> tuple[dict, list[dict]]:
    cfg = _cfg(tokenizer_dir)
    policy = build_model(cfg.model, load_tokenizer(tokenizer_dir))
    consumer = Consumer(policy, cfg)
    metrics = [consumer.train_iteration(_groups(policy.config.vocab_size, it), it, it) for it in range(len(PLAN))]
    return policy.state_dict(), metrics


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_data_parallel_matches_single_process(rank_pool, tokenizer_dir, tmp_path, parallel):
    """2 gloo ranks, 2 iterations: ranks take 3 + 1 groups, then 0 + 4 (rank 0 none), each rank
    in its own order; after each iteration's one reduction the weights equal the single-process
    run's on the same groups (fp64, <= 1e-10), and so do the iteration's token count and loss."""
    rank_pool.run(_train_ranks, (2, _free_port(), str(tokenizer_dir), parallel, str(tmp_path)))
    single, single_metrics = _single_process(tokenizer_dir)
    start = build_model(_cfg(tokenizer_dir).model, load_tokenizer(tokenizer_dir)).state_dict()
    assert max((single[k] - start[k]).abs().max().item() for k in single) > 1e-3, "training must move the weights"
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["version"] == len(PLAN)
        assert max((got["state"][k] - single[k]).abs().max().item() for k in single) <= 1e-10
        for m, ref in zip(got["metrics"], single_metrics):
            assert m["tokens"] == ref["tokens"] and m["sequences"] == ref["sequences"]
            assert m["loss"] == pytest.approx(ref["loss"], abs=1e-12)
            assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-10)


def _fsdp_layout(rank: int, world: int, port: int, tokenizer_dir: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from periodic_async.parallel.distributed import init_ranks

    _join_ranks(rank, world, port)
    cfg = _cfg(tokenizer_dir, "fsdp")
    ranks = init_ranks(cfg)
    policy = build_model(cfg.model, load_tokenizer(tokenizer_dir))
    consumer = Consumer(policy, cfg, ranks=ranks)
    tri = consumer.tri
    layout = {}
    for (name, p), (_, o), (_, r) in zip(policy.named_parameters(), tri.old.named_parameters(),
                                         tri.ref.named_parameters()):
        assert all(isinstance(t, DTensor) for t in (p, o, r)), name
        layout[name] = [(tuple(t.placements), tuple(t.to_local().shape), tuple(t.shape)) for t in (p, o, r)]
    groups = _groups(policy.config.vocab_size, 0)
    consumer.train_iteration([groups[i] for i in PLAN[0][rank]], 0, 0)  # refreshes old on every rank
    moved = [(p.to_local() - r.to_local()).abs().max().item()
             for p, r in zip(policy.parameters(), tri.ref.parameters())]
    # Each rank refreshes old ALONE while the other waits on the store, in no collective: a
    # refresh that communicated would hang here (and fail on the 30 s timeout).
    with torch.no_grad():
        for o in tri.old.parameters():
            o.to_local().zero_()
    store = ranks.store
    if rank == 1:
        store.wait(["refreshed0"], datetime.timedelta(seconds=300))
    tri.refresh_old()
    store.set(f"refreshed{rank}", "1")
    equal = all(torch.equal(o.to_local(), p.to_local()) for o, p in zip(tri.old.parameters(), policy.parameters()))
    torch.save({"layout": layout, "moved": max(moved), "equal": equal}, Path(out) / f"rank{rank}.pt")
    store.wait(["refreshed1"], datetime.timedelta(seconds=300))
    ranks.close()


def test_fsdp_tri_model_layout(rank_pool, tokenizer_dir, tmp_path):
    """FSDP2: every parameter of old and ref has the policy's placements and local shard shape
    (sharded: each rank holds part of it), and refresh_old, run by one rank at a time with the
    other outside any collective, copies the policy's local shards into old exactly."""
    rank_pool.run(_fsdp_layout, (2, _free_port(), str(tokenizer_dir), str(tmp_path)))
    shards = []
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["equal"], f"rank {rank}: old != policy after refresh_old"
        assert got["moved"] > 1e-4, "the policy must have left the reference (else the copy proves nothing)"
        for name, (policy, old, ref) in got["layout"].items():
            assert policy == old == ref, name
            assert "Shard(dim=0)" in str(policy[0]), name
        shards.append({n: v[0][1] for n, v in got["layout"].items()})
    assert any(shards[0][n][0] < got["layout"][n][0][2][0] for n in shards[0]), "nothing is sharded"


def _cli_overrides(tokenizer_dir, out: Path) -> list[str]:
    return [f"model.tokenizer={tokenizer_dir}", "model.name_or_path=qwen2-micro", "model.dtype=float64",
            "model.device=cpu", "model.seed=3", "data.num_train=64", "data.num_eval=0", "data.seed=5",
            f"reward.functions={DIVERSITY_REWARD}", "engine.backend=local",
            "engine.max_num_seqs=6", "engine.max_tokens=12", "engine.stop=e", "algorithm.group_size=3",
            "algorithm.prompts_per_iteration=6", "algorithm.lr=3e-3", "algorithm.micro_batch_tokens=120",
            "algorithm.beta=0.05", "trainer.iterations=2", f"trainer.output_dir={out}", "trainer.eval_at_end=false",
            "pipeline.mode=periodic-async", "logging.wandb_mode=disabled", "logging.progress=false"]


@pytest.mark.slow
def test_torchrun_train_matches_single_process(tokenizer_dir, tmp_path):
    """`torchrun --nproc-per-node=2 -m periodic_async train`: rank 0 runs the producer (in-process
    engine) and hands groups out through the rendezvous store, both ranks train; the sampled
    tokens and the final weights (fp64, <= 1e-10) are those of the single-process run."""
    from transformers import AutoModelForCausalLM

    from periodic_async.pipeline import run
    from periodic_async.trace import read_jsonl

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port", str(_free_port()),
           "-m", "periodic_async", "train", *_cli_overrides(tokenizer_dir, tmp_path / "ranks")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    taken = re.search(r'"groups_trained": \[([\d,\s]*)\]', done.stdout)  # rank 1's summary
    assert taken and sum(int(x) for x in taken.group(1).split(",")) > 0, "rank 1 must have trained groups"
    cfg = load_config(RunConfig, None, _cli_overrides(tokenizer_dir, tmp_path / "one"))
    run(cfg)
    rows = {d: read_jsonl(tmp_path / d / "rollouts.jsonl") for d in ("ranks", "one")}
    key = lambda r: (r["iteration"], r["prompt_index"], r["version"])  # noqa: E731
    assert {key(r): r["response_ids"] for r in rows["ranks"]} == {key(r): r["response_ids"] for r in rows["one"]}
    assert len(rows["ranks"]) == 2 * 6
    weights = {d: AutoModelForCausalLM.from_pretrained(tmp_path / d / "checkpoint", dtype=torch.float64).state_dict()
               for d in ("ranks", "one")}
    start = build_model(cfg.model, load_tokenizer(tokenizer_dir)).state_dict()
    assert max((weights["one"][k] - start[k]).abs().max().item() for k in start) > 1e-3
    assert max((weights["ranks"][k] - weights["one"][k]).abs().max().item() for k in start) <= 1e-10


# --- checkpoints across ranks: written by N ranks, resumed by N ranks or by one process, and back ---------------


def _ckpt_cfg(tokenizer_dir, out: Path, parallel: str, **extra) -> RunConfig:
    overrides = dict(o.split("=", 1) for o in _cli_overrides(tokenizer_dir, out))
    overrides.update({"trainer.parallel": parallel, "trainer.iterations": 3, "trainer.save_every": 1,
                      "trainer.keep_last": 3, "reward.timeout_s": 0, "logging.trace": False})
    overrides.update(extra)
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])


def _pipeline_ranks(rank: int, world: int, ports: list[int], tokenizer_dir: str, parallel: str,
                    runs: list[tuple[str, dict]]) -> None:
    """`pipeline.run` on each rank, once per (output_dir, overrides) in `runs`, each run in a
    process group of its own (run closes it), as torchrun would start them one after the other."""
    from periodic_async.pipeline import run

    for port, (out, extra) in zip(ports, runs):
        _join_ranks(rank, world, port)
        run(_ckpt_cfg(tokenizer_dir, Path(out), parallel, **extra))


def _ckpt_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(ckpt / "model.safetensors")


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _tokens(out: Path, iteration: int) -> dict:
    from periodic_async.trace import read_jsonl

    return {r["prompt_index"]: r["response_ids"] for r in read_jsonl(out / "rollouts.jsonl")
            if r["iteration"] == iteration}


# slow under FSDP (its sharded checkpoint); DDP is the default case
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_resume_matches_uninterrupted(rank_pool, tokenizer_dir, tmp_path, parallel):
    """Checkpoints are the single process's whatever the ranks and layout. 2 ranks train
    iterations 0..2 with a checkpoint after each (full); 2 new ranks resume from its
    checkpoint-2 (mid-run, written by 2 ranks) and from a checkpoint-2 written by one process;
    one process resumes from the 2 ranks' checkpoint-2. All four sample the same tokens in
    iteration 2 and end on the same weights (fp64, <= 1e-10), which training moved; the 2 ranks'
    files are those of one process (safetensors keys, optimizer state by parameter index)."""
    from periodic_async import checkpoint
    from periodic_async.pipeline import run
    from periodic_async.trace import read_jsonl

    one = tmp_path / "one"  # one process, iterations 0..1
    run(_ckpt_cfg(tokenizer_dir, one, parallel, **{"trainer.iterations": 2}))
    runs = [(str(tmp_path / "full"), {}),
            (str(tmp_path / "resumed"), {"trainer.resume": str(tmp_path / "full" / "checkpoint-2")}),
            (str(tmp_path / "from_one"), {"trainer.resume": str(one / "checkpoint-2")})]
    rank_pool.run(_pipeline_ranks, (2, [_free_port() for _ in runs], str(tokenizer_dir), parallel, runs))
    full = tmp_path / "full"
    assert list(checkpoint.complete_checkpoints(full)) == [1, 2, 3]
    # devices: the trainer ranks (in-process engine: no engine devices)
    assert {m["throughput/devices"] for m in read_jsonl(full / "metrics.jsonl")} == {2}
    assert json.loads((full / "summary.json").read_text())["devices"] == 2
    assert {m["throughput/devices"] for m in read_jsonl(one / "metrics.jsonl")} == {1}
    one_resumed = tmp_path / "one_resumed"  # one process from the 2 ranks' checkpoint
    run(_ckpt_cfg(tokenizer_dir, one_resumed, parallel, **{"trainer.resume": str(full / "checkpoint-2")}))

    assert _diff(_ckpt_weights(full / "checkpoint-2"), _ckpt_weights(one / "checkpoint-2")) <= 1e-10
    want = _ckpt_weights(full / "checkpoint-3")
    start = _ckpt_weights(full / "checkpoint-1")
    assert _diff(want, start) > 1e-3, "training must move the weights"
    for d in ("resumed", "from_one", "one_resumed"):
        out = tmp_path / d
        assert checkpoint.latest(out).name == "checkpoint-3", d
        assert {r["iteration"] for r in read_jsonl(out / "rollouts.jsonl")} == {2}, f"{d}: not resumed"
        assert _tokens(out, 2) == _tokens(full, 2) and len(_tokens(out, 2)) == 6, d
        assert _diff(_ckpt_weights(out / "checkpoint-3"), want) <= 1e-10, d
    # the same files as one process writes: the tied lm_head once, the optimizer state by index
    files = {p.name for p in (full / "checkpoint-3").iterdir()} - {"rng_state.pt"}
    assert files == {p.name for p in (one_resumed / "checkpoint-3").iterdir()} - {"rng_state.pt"}
    assert want.keys() == _ckpt_weights(one / "checkpoint-2").keys() and "lm_head.weight" not in want
    ranks_state = torch.load(full / "checkpoint-3" / "trainer_state.pt", weights_only=True)
    one_state = torch.load(one_resumed / "checkpoint-3" / "trainer_state.pt", weights_only=True)
    assert ranks_state["optimizer"]["param_groups"] == one_state["optimizer"]["param_groups"]
    assert ranks_state["optimizer"]["state"].keys() == one_state["optimizer"]["state"].keys()
    assert max((a[k] - b[k]).abs().max().item() for i, a in ranks_state["optimizer"]["state"].items()
               for b in [one_state["optimizer"]["state"][i]] for k in ("exp_avg", "exp_avg_sq")) <= 1e-10


def test_ranks_with_held_out_evaluation_match_single_process(rank_pool, tokenizer_dir, tmp_path):
    """2 trainer ranks with held-out evaluation every version (data.num_eval=16,
    trainer.eval_every=1): rank 0 leaves an iteration once every group is claimed, while the
    held-out requests may still be generating; its barrier waits for them (a push into a
    generating engine raises). The ranks sample the single process's tokens, evaluate the same
    versions with the same results and end on its weights (fp64, <= 1e-10)."""
    from periodic_async.pipeline import run
    from periodic_async.trace import read_jsonl

    extra = {"data.num_eval": 16, "trainer.eval_every": 1, "trainer.iterations": 2, "trainer.save_every": 0}
    ranks, one = tmp_path / "ranks", tmp_path / "one"
    rank_pool.run(_pipeline_ranks, (2, [_free_port()], str(tokenizer_dir), "ddp", [(str(ranks), extra)]))
    run(_ckpt_cfg(tokenizer_dir, one, "ddp", **extra))
    key = lambda r: (r["iteration"], r["position"], r["prompt_index"], r["version"])  # noqa: E731
    rows = {d: {key(r): r["response_ids"] for r in read_jsonl(d / "rollouts.jsonl")} for d in (ranks, one)}
    assert rows[ranks] == rows[one] and len(rows[ranks]) == 2 * 6
    evals = {d: [(r["step"], r["correct"]) for r in read_jsonl(d / "eval.jsonl")] for d in (ranks, one)}
    assert [s for s, _ in evals[ranks]] == [0, 1] and evals[ranks] == evals[one]
    assert _diff(_ckpt_weights(ranks / "checkpoint-2"), _ckpt_weights(one / "checkpoint-2")) <= 1e-10
