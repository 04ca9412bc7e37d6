"""SIGINT / SIGTERM become `Interrupted` in the main thread, wait for the end of a deferred block
(the optimizer step and its version change together), and a second signal while stopping is
ignored. (The CLI end to end: tests/test_checkpoint.py::test_sigterm_leaves_no_processes.)"""

import signal

import pytest

from periodic_async import interrupt


def _signal_self(signum: int) -> None:
    """Send `signum` to this thread and run its Python handler before returning (raise_signal
    checks for signals at once: no wait for another thread to pass the signal on)."""
    signal.raise_signal(signum)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_raises_interrupted(signum, code):
    before = signal.getsignal(signal.SIGTERM)
    with interrupt.handle_signals():
        with pytest.raises(KeyboardInterrupt) as e:
            _signal_self(signum)
            pytest.fail("the signal was not raised")
    assert isinstance(e.value, interrupt.Interrupted) and e.value.exit_code == code
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handlers are back


def test_signal_inside_deferred_block_waits_for_its_end():
    steps = []
    with interrupt.handle_signals():
        with pytest.raises(interrupt.Interrupted):
            with interrupt.deferred():
                _signal_self(signal.SIGTERM)
                steps.append("step")  # still runs: the signal waits
                with interrupt.deferred():  # nested: raised at the outermost end only
                    steps.append("version")
                steps.append("after nested")
            steps.append("never")
        _signal_self(signal.SIGTERM)  # already stopping: ignored
        steps.append("cleanup")
    assert steps == ["step", "version", "after nested", "cleanup"]


def test_without_handlers_nothing_is_deferred():
    """Library use (no handlers installed): a SIGINT inside a deferred block is Python's own
    KeyboardInterrupt, raised at once."""
    # Python's own handler, whatever this process inherited (a shell starts background jobs
    # with SIGINT ignored, and Python then leaves it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            with interrupt.deferred():
                _signal_self(signal.SIGINT)
                steps.append("not reached")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert steps == [] and not isinstance(e.value, interrupt.Interrupted)
