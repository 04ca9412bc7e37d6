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
