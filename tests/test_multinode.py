"""Multi-node code paths on one machine: a real Ray cluster of three nodes (`ray.cluster_utils.Cluster`:
a head with no CPU and two worker nodes of 1 CPU, each node its own raylet, object store and worker
processes, all at this machine's network address, not the loopback). The engine joins it through
`engine.ray_address` (init_ray's join path), places one worker per node (a 1-CPU bundle fits on no
node twice) and must sample what a one-process engine samples, before and after a weight push by the
object store (the weights cross object stores) and by a gloo broadcast (the trainer hosts the store
on its node's address, `ray.util.get_node_ip_address()`); a 2-iteration periodic-async
`pipeline.run` on it must give the one-process run's rollouts and weights.

NOT covered: separate machines (a real network between nodes, different file systems, clocks and
Python environments), GPUs on workers (nccl), node failures, torchrun trainer ranks on several nodes.
"""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from periodic_async.config import RunConfig  # noqa: E402
from periodic_async.engine import make_engine  # noqa: E402
from periodic_async.model import load_policy  # noqa: E402

from helpers import (by_prompt, checkpoint_weights, engine_samples, max_abs_diff, read_rollouts,  # noqa: E402
                     stop_shared_ray, tiny_run_config, worker_weights)

NODE_STORE_BYTES = 100 * 2**20
"""Object store of each node (the machine is small and shared)."""


def _session_processes(session_dir: str) -> set[int]:
    """Processes whose command line names the cluster's session directory: the nodes' services
    (gcs, raylets, agents) and the worker processes (actors included) the raylets started."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(session_dir in a for a in p.info["cmdline"] or ()):
            pids.add(p.pid)
    return pids


def _node_pids(cluster) -> set[int]:
    """The processes Ray recorded for the cluster's nodes, and their children (the workers)."""
    import psutil

    pids = set()
    for node in cluster.list_all_nodes():
        for infos in node.all_processes.values():
            for info in infos:
                pids.add(info.process.pid)
                try:
                    pids.update(c.pid for c in psutil.Process(info.process.pid).children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
    return pids


def _alive(pids: set[int]) -> set[int]:
    import psutil

    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="module")
def cluster():
    """Head (0 CPU: nothing of ours can run there) + two 1-CPU worker nodes; torn down completely."""
    from ray.cluster_utils import Cluster

    stop_shared_ray()  # another module's (conftest.ray_session): this one needs the driver free to join
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, object_store_memory=NODE_STORE_BYTES,
                                                          include_dashboard=False))
    session = c.head_node.get_session_dir_path()
    pids: set[int] = set()
    try:
        for i in range(2):
            c.add_node(num_cpus=1, object_store_memory=NODE_STORE_BYTES, resources={f"node{i}": 1})
        c.wait_for_nodes()
        yield c
        pids = _node_pids(c) | _session_processes(session)
        raylets = {n.all_processes["raylet"][0].process.pid for n in c.list_all_nodes()}
        assert raylets <= pids and len(raylets) == 3
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
    deadline = time.time() + 30
    while (_alive(pids) or _session_processes(session)) and time.time() < deadline:
        time.sleep(0.2)
    left = _alive(pids) | _session_processes(session)
    assert c.head_node is None and not c.worker_nodes
    assert not left, f"cluster processes left after shutdown: {sorted(left)}"


def _cfg(tmp, tokenizer_dir, name: str, **extra) -> RunConfig:
    """The tiny run (conftest), 2 iterations of periodic-async, its engine on the cluster: two
    workers of 1 CPU each (a worker node holds one)."""
    return tiny_run_config(tmp / name, tokenizer_dir, **{
        "engine.cpus_per_worker": 1, "engine.timeout_s": 120, "engine.placement_timeout_s": 30,
        "trainer.iterations": 2, **extra})


def _samples(engine) -> dict:
    return engine_samples(engine, 6)


def _pushed(cfg) -> dict[str, torch.Tensor]:
    """Version 1: the initial weights plus noise (differs from what the workers built)."""
    policy, _ = load_policy(cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def _reference(cfg, pushed) -> tuple[dict, dict]:
    """Tokens of a one-process engine (engine.backend=local) at version 0 and at `pushed`."""
    local = make_engine(cfg.engine, cfg.model, backend="local")
    before = _samples(local)
    local.update_weights(pushed, 1)
    return before, _samples(local)


def _check_two_nodes(engine, cluster) -> None:
    info = engine.info()
    nodes = [i["node_id"] for i in info]
    assert len(set(nodes)) == 2, f"both workers on one node: {info}"
    assert set(nodes) == {n.node_id for n in cluster.worker_nodes}  # not the head: it has no CPU
    assert {i["node_ip"] for i in info} == {cluster.head_node.node_ip_address}


@pytest.fixture(scope="class")
def engine(cluster, tokenizer_dir, tmp_path_factory):
    """The object-store engine of TestObjectStoreSync, started by joining the cluster by address
    (ray not running: init_ray connects this process as a driver). Class-scoped: its CPUs are
    free again for the collective test's engine."""
    cfg = _cfg(tmp_path_factory.mktemp("engine"), tokenizer_dir, "engine", **{"engine.ray_address": cluster.address})
    assert not ray.is_initialized()
    engine = make_engine(cfg.engine, cfg.model)
    try:
        yield engine
    finally:
        engine.close()
    assert not ray.is_initialized()  # close() disconnected the driver it connected ...
    assert cluster.remaining_processes_alive()  # ... and left the cluster up


class TestObjectStoreSync:
    """One engine for both tests (a worker starts in ~10 s here, more on a loaded machine)."""

    def test_engines_on_two_nodes_match_one_node(self, cluster, engine, tokenizer_dir, tmp_path):
        """init_ray joins the cluster by address; a worker per worker node; the tokens of seeded
        requests equal a one-process engine's, at version 0 and after an object-store push of
        version 1 (which every worker reports, holding the pushed weights bitwise)."""
        cfg = _cfg(tmp_path, tokenizer_dir, "ref")
        pushed = _pushed(cfg)
        want_before, want_after = _reference(cfg, pushed)
        assert want_before != want_after
        assert engine._owns_ray  # init_ray joined the cluster (ray was not running)
        assert ray.get_runtime_context().gcs_address == cluster.address
        assert len([n for n in ray.nodes() if n["Alive"]]) == 3
        _check_two_nodes(engine, cluster)
        assert _samples(engine) == want_before
        engine.update_weights(pushed, 1)
        assert [i["version"] for i in engine.info()] == [1, 1]
        for weights in worker_weights(engine):
            assert all(torch.equal(weights[k], pushed[k]) for k in pushed)
        assert _samples(engine) == want_after

    def test_pipeline_on_the_cluster_matches_one_process(self, cluster, engine, tokenizer_dir, tmp_path):
        """`pipeline.run` of 2 periodic-async iterations on the engine of the cluster (a worker on
        each worker node, weights pushed through the object stores at the barriers) samples the
        rollouts of the same run on the one-process engine, and trains to the same weights (fp64)."""
        from periodic_async.pipeline import run

        on_cluster = _cfg(tmp_path, tokenizer_dir, "cluster", **{"engine.ray_address": cluster.address})
        one_process = _cfg(tmp_path, tokenizer_dir, "local", **{"engine.backend": "local"})
        run(one_process)
        run(on_cluster, engine=engine)
        _check_two_nodes(engine, cluster)
        want, got = (by_prompt(read_rollouts(c.trainer.output_dir)) for c in (one_process, on_cluster))
        assert len(want) == 2 * 6 and got == want
        assert {v for _, _, v in got.values()} == {0, 1}
        assert len({str(r) for _, r, _ in got.values()}) > 1, "rewards must vary, or the test proves nothing"
        w_one, w_cluster = (checkpoint_weights(f"{c.trainer.output_dir}/checkpoint") for c in (one_process, on_cluster))
        assert max_abs_diff(w_one, w_cluster) <= 1e-10


def test_collective_sync_across_nodes(cluster, tokenizer_dir, tmp_path):
    """engine.weight_sync=collective on the cluster: the trainer hosts the group's store at its
    node's address (not the loopback), gloo broadcasts to a worker on each node; both hold the
    pushed weights bitwise (twice: the second push reuses the buffers) and sample what a
    one-process engine samples."""
    cfg = _cfg(tmp_path, tokenizer_dir, "collective", **{
        "engine.ray_address": cluster.address, "engine.weight_sync": "collective",
        "engine.weight_sync_bucket_mb": 0.5})  # several buckets
    pushed = _pushed(cfg)
    _, want_after = _reference(cfg, pushed)
    assert not ray.is_initialized()
    with make_engine(cfg.engine, cfg.model) as engine:
        assert engine.sync.host is None  # a cluster: the node's address, found at attach
        _check_two_nodes(engine, cluster)
        for version in (1, 2):
            engine.update_weights(pushed, version)
        assert len(engine.sync._buffers) > 2, "the test wants several buckets"
        assert [i["version"] for i in engine.info()] == [2, 2]
        host = ray.util.get_node_ip_address()
        assert host == cluster.head_node.node_ip_address and host != "127.0.0.1"
        for weights in worker_weights(engine):
            assert all(torch.equal(weights[k], pushed[k]) for k in pushed)
        assert _samples(engine) == want_after
    assert not ray.is_initialized()
