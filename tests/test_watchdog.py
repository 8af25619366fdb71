"""The collective timeout without a thread per collective (collectives/watchdog)."""

import pytest

import multiworker

pytestmark = pytest.mark.multiworker


STALL_TIMEOUT = 5  # seconds


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = multiworker.launch_workers(
        "stalled_worker.py", 2, tmp_path_factory.mktemp("stall"),
        why="a stalled collective times out, which ends TensorFlow's collective executor for good",
        args=[f"--stall_timeout={STALL_TIMEOUT}"], timeout=240)
    assert run.results[0] is not None, run.output[-6000:]
    return run


def test_a_fast_fit_holds_no_thread_per_collective(run):
    # 300 steps under the default 300 s timeout: TensorFlow's own timeout
    # would hold a sleeping thread per collective (6 per step, measured).
    result = run.results[0]
    assert result["threads_after"] - result["threads_before"] < 30, result


def test_a_stalled_worker_fails_the_others_after_the_timeout(run):
    # Worker 1 sleeps in a callback: alive, so TensorFlow's heartbeats see
    # nothing wrong; worker 0's watchdog stops its collectives.
    stall = run.results[0]["stall"]
    assert stall is not None, run.output[-6000:]
    # It fired after the timeout, while worker 1 still slept (until worker 0
    # reported, at most 4 timeouts).
    assert STALL_TIMEOUT <= stall["seconds"] < 4 * STALL_TIMEOUT, stall
    assert (f"of this worker waited {STALL_TIMEOUT} s for the other workers with "
            "none completing (the collective timeout, "
            "CommunicationOptions.timeout_seconds)") in stall["error"]
