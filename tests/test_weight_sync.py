"""Collective weight sync (engine/collective.py) against the object-store path: real Ray workers,
a real gloo process group between the trainer and the workers."""

import pytest
import torch

from periodic_async.config import RunConfig, load_config
from periodic_async.engine import make_engine
from periodic_async.engine.collective import aliases, layout
from periodic_async.model import load_policy

from helpers import engine_samples, worker_weights


def _cfg(tokenizer_dir, weight_sync: str) -> RunConfig:
    overrides = {"model.name_or_path": "qwen2-micro", "model.tokenizer": str(tokenizer_dir), "model.device": "cpu",
                 "engine.backend": "ray", "engine.num_workers": 2, "engine.max_num_seqs": 4,
                 "engine.weight_sync": weight_sync, "engine.weight_sync_bucket_mb": 0.02}  # ~20 KiB: several buckets
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])


def _samples(engine) -> dict:
    return engine_samples(engine, 4, logprobs=True)


def test_layout_packs_every_tensor_once_aligned():
    """Buckets hold each tensor once (a tied one once, its other name kept as an alias: vLLM needs a
    tied embedding under both names), at 64-byte aligned offsets, within the bound."""
    a, b = torch.randn(10, 7), torch.randn(300)
    state = {"a": a, "tied": a, "b": b, "h": torch.ones(3, dtype=torch.bfloat16)}
    buckets = layout(state, bucket_bytes=512)
    names = [e[0] for bk in buckets for e in bk["entries"]]
    assert names == ["a", "b", "h"]
    assert all(e[3] % 64 == 0 for bk in buckets for e in bk["entries"])
    assert len(buckets) == 3  # 280 B, then 1200 B (alone: larger than the bound), then 6 B
    assert aliases(state) == [("tied", "a")]


@pytest.mark.slow  # half a minute; the default suite checks the collective push in test_vllm and test_multinode
def test_collective_sync_matches_object_store(tokenizer_dir):
    """Version 1 (the initial weights plus noise, so it differs from what the workers built) is
    pushed to two workers through the object store and to two others by broadcast in several
    buckets: all four hold bitwise the pushed weights and sample identical tokens and log-probs,
    which differ from version 0's (so the weights did arrive)."""
    store_cfg, coll_cfg = _cfg(tokenizer_dir, "object_store"), _cfg(tokenizer_dir, "collective")
    policy, _ = load_policy(store_cfg.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pushed = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    with make_engine(store_cfg.engine, store_cfg.model) as by_store:
        with make_engine(coll_cfg.engine, coll_cfg.model) as by_broadcast:
            assert len(by_broadcast.sync._buffers) == 0 and by_broadcast.sync._group is not None
            before = _samples(by_broadcast)
            for version in (1, 2):  # twice: the second reuses the buffers on both sides
                by_store.update_weights(pushed, version)
                by_broadcast.update_weights(pushed, version)
            assert len(by_broadcast.sync._buffers) > 2, "the test wants several buckets"
            for weights in worker_weights(by_store) + worker_weights(by_broadcast):
                assert all(torch.equal(weights[k], pushed[k]) for k in pushed)
            via_store, via_broadcast = _samples(by_store), _samples(by_broadcast)
            assert via_store == via_broadcast
            assert via_broadcast != before
            assert by_broadcast.version == 2


def test_collective_needs_the_ray_backend(tokenizer_dir):
    from periodic_async.config import ConfigError

    with pytest.raises(ConfigError, match="engine.weight_sync"):
        load_config(RunConfig, None, ["engine.backend=local", "engine.weight_sync=collective"])


def test_collective_refuses_members_sharing_a_device():
    """nccl/hccl cannot hold two members of a group on one device: the check names who shares
    which device (on CUDA the ids are device uuids: tests/test_gpu.py)."""
    from periodic_async.config import ConfigError
    from periodic_async.engine.collective import _accelerator_id, _check_devices_apart

    here = _accelerator_id(device=torch.device("cpu"))
    _check_devices_apart(torch.device("cpu"), ["other-0", "other-1"])  # all apart: no error
    with pytest.raises(ConfigError, match="engine worker 0 and engine worker 1 are on the same accelerator"):
        _check_devices_apart(torch.device("cpu"), ["other", "other"])
    with pytest.raises(ConfigError, match=f"the trainer and engine worker 1 are on the same accelerator \\({here}\\)"):
        _check_devices_apart(torch.device("cpu"), ["other", here])
