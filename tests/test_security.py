"""Security defaults: a local Ray cluster started by the engines listens on the loopback
interface only (nothing on the machine's network can reach its object store or submit work).
The other guarantees are tested beside their code: no secrets in saved files
(test_config.py::test_saved_run_info_has_no_secrets), reward code only from what is named
(test_reward.py::test_reward_worker_imports_only_what_is_named)."""

import ipaddress

import pytest


def _loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (::ffff:127.0.0.1: gRPC's sockets)."""
    a = ipaddress.ip_address(ip.split("%")[0])
    return a.is_loopback or bool(getattr(a, "ipv4_mapped", None) and a.ipv4_mapped.is_loopback)


def _listening(processes) -> list[tuple[str, str, int]]:
    """(process name, ip, port) of every listening TCP socket and bound UDP socket of `processes`."""
    import psutil

    out = []
    for p in processes:
        try:
            for c in p.net_connections(kind="inet"):
                if c.laddr and (c.status == psutil.CONN_LISTEN or c.type == 2):  # 2: SOCK_DGRAM
                    out.append((p.name(), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return out


def test_local_ray_listens_on_loopback_only(ray_session, tokenizer_dir):
    psutil = pytest.importorskip("psutil")
    ray = ray_session  # started in this process by the engines' init_ray (conftest), as a run starts it

    from periodic_async.config import EngineConfig, ModelConfig
    from periodic_async.engine.ray_engine import RayEngine

    engine = RayEngine(EngineConfig(num_workers=1, max_num_seqs=2),
                       ModelConfig(name_or_path="qwen2-micro", tokenizer=str(tokenizer_dir)))
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        me = psutil.Process()
        sockets = _listening([me] + me.children(recursive=True))
    finally:
        engine.close()
    assert len(sockets) >= 3, sockets  # GCS, raylet, the worker: something was checked
    assert [s for s in sockets if not _loopback(s[1])] == [], sockets


JOIN = """
import json, os, ray
from periodic_async.config import EngineConfig
from periodic_async.engine.ray_engine import init_ray
from periodic_async.parallel.affinity import engine_cores

cfg = EngineConfig(backend="ray")  # engine.ray_address empty: RAY_ADDRESS
init_ray(cfg)

@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address(), os.getpid()

print(json.dumps({"address": cfg.ray_address, "on_this_machine": cfg.ray_on_this_machine, "nodes": len(ray.nodes()),
                  "gcs": ray.get_runtime_context().gcs_address, "task": ray.get(where.remote()),
                  "cores": engine_cores(cfg)}))
ray.shutdown()
"""


def test_run_joins_this_machines_ray_at_its_loopback_address(ray_session):
    """A run whose RAY_ADDRESS names this machine's Ray at its loopback address (as `QUICK=1 bash
    run_all.sh` gives its experiments one instance) joins that instance over the loopback: Ray's
    multi-node mode would turn 127.0.0.1 into the machine's network address and never connect.
    The instance counts as this machine ('auto' core pinning applies as to a local start)."""
    import json
    import os
    import subprocess
    import sys

    from periodic_async.parallel.affinity import SUPPORTED, available_cores

    psutil = pytest.importorskip("psutil")
    address = ray_session.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:"), address
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    env = {**os.environ, "RAY_ADDRESS": address}  # RAY_AUTH_MODE: as ray.init set it here
    out = subprocess.run([sys.executable, "-c", JOIN], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["address"] == address and got["on_this_machine"] and got["gcs"] == address
    assert got["nodes"] == 1 and got["task"][0] == "127.0.0.1"  # no new instance; the task ran on this one
    assert got["task"][1] not in before  # a worker of the joined run's own
    assert got["cores"] == ([available_cores()[:1]] if SUPPORTED else None)  # 'auto' pins its worker
