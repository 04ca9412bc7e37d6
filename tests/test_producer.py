"""The producer's guarantees on a real in-process engine: the stream never loses the iteration's
last items to a time-out race; a prompt drawn twice in one iteration gets two different groups
(sampling seeds by position); the pipeline refuses a group of another iteration or a position
delivered twice."""

import queue
import threading

import pytest

from periodic_async.data import iteration_prompts, load_examples
from periodic_async.engine import make_engine
from periodic_async.producer import Producer

from helpers import diversity_reward, tiny_run_config


def _cfg(tmp_path, tokenizer_dir, **extra):
    return tiny_run_config(tmp_path, tokenizer_dir, **{"engine.backend": "local", **extra})


@pytest.fixture(scope="module")
def engine(tokenizer_dir, tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("e"), tokenizer_dir)
    with make_engine(cfg.engine, cfg.model, backend="local") as eng:
        yield eng


def _producer(engine, tokenizer, cfg) -> Producer:
    return Producer(engine, tokenizer, load_examples(cfg.data, "train"), [], diversity_reward, cfg)


class _LateQueue(queue.Queue):
    """A real queue whose time-outs are slow: before a `get` reports Empty, the producer thread
    runs to its end (everything it puts lands between the time-out and the stream's next look)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.thread: threading.Thread | None = None
        self.timeouts = 0

    def get(self, block=True, timeout=None):
        try:
            return super().get(block, timeout)
        except queue.Empty:
            self.timeouts += 1
            self.thread.join()
            raise


def test_stream_takes_items_that_land_after_a_time_out(engine, tokenizer, tokenizer_dir, tmp_path):
    """The producer puts its last groups and the end of the iteration, and its thread ends, between
    the consumer's queue time-out and its check that the thread still lives: the stream drains
    the queue once more and delivers all B groups instead of failing."""
    cfg = _cfg(tmp_path, tokenizer_dir)
    producer = _producer(engine, tokenizer, cfg)
    late = producer.queue = _LateQueue(producer.queue.maxsize)
    producer.start(0)
    late.thread = producer._thread
    groups = list(producer.stream(poll_s=0.001))
    assert late.timeouts >= 1, "no time-out happened: the race was not exercised"
    assert sorted(g.timings["position"] for g in groups) == list(range(cfg.algorithm.prompts_per_iteration))


def test_no_two_groups_of_an_iteration_share_prompt_and_seed(engine, tokenizer, tokenizer_dir, tmp_path):
    """n=10 prompts, B=4: an iteration that spans two epochs can draw a prompt twice (11 of the
    first 200 iterations do with data.seed=5). Over those 200 iterations no two requests of an iteration share
    (prompt, seed), and the seeds are the same on a second producer (a pure function: every
    mode and a resume sample the same tokens); generating such an iteration gives the twice
    drawn prompt two different groups."""
    cfg = _cfg(tmp_path, tokenizer_dir, **{"data.num_train": 10, "algorithm.prompts_per_iteration": 4})
    producer, again = _producer(engine, tokenizer, cfg), _producer(engine, tokenizer, cfg)
    twice = []
    for t in range(200):
        requests = producer.iteration_requests(t)
        keys = [(i, r.seed) for r, i, _ in requests]
        assert len(set(keys)) == len(keys) == 4, f"iteration {t}: {keys}"
        assert [r.seed for r, _, _ in again.iteration_requests(t)] == [r.seed for r, _, _ in requests]
        indices = [i for i, _ in iteration_prompts(producer.examples, t, 4, cfg.data.seed)]
        assert [i for _, i, _ in requests] == indices
        if len(set(indices)) < 4:
            twice.append(t)
    assert len(twice) >= 5, twice
    producer.start(twice[0])
    groups = list(producer.stream())
    by_index: dict[int, list] = {}
    for g in groups:
        by_index.setdefault(g.prompt_index, []).append(g.response_ids)
    repeated = [v for v in by_index.values() if len(v) == 2]
    assert repeated and all(a != b for a, b in repeated), "a prompt drawn twice sampled the same group twice"


def test_received_refuses_a_group_of_another_iteration_or_a_position_twice(engine, tokenizer, tokenizer_dir,
                                                                           tmp_path):
    """The B groups an iteration trains are its B distinct positions, each tagged with the
    iteration: the pipeline's `_Received` passes a real iteration's groups and refuses a group
    delivered twice, one of another iteration, or a stream that ends short."""
    from periodic_async.pipeline import _Received

    cfg = _cfg(tmp_path, tokenizer_dir)
    producer = _producer(engine, tokenizer, cfg)
    producer.start(1)
    groups = list(producer.stream())
    B = cfg.algorithm.prompts_per_iteration
    assert sorted(g.timings["position"] for g in _Received(groups, 1, B)) == list(range(B)), "the real groups pass"
    with pytest.raises(RuntimeError, match="position .* twice"):
        list(_Received(groups + groups[:1], 1, B))
    with pytest.raises(RuntimeError, match="iteration 2: .* of iteration 1"):
        list(_Received(groups, 2, B))
    with pytest.raises(RuntimeError, match="positions \\[5\\] missing"):
        list(_Received([g for g in groups if g.timings["position"] != 5], 1, B))
