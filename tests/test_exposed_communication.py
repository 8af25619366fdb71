"""`Strategy.exposed_communication_seconds`: each step's wait on all-reduces."""

import pytest
import statistics

from multiworker import assert_succeeded
from multiworker import run_workers

pytestmark = pytest.mark.multiworker


DELAY = 1.0


def test_exposed_communication_is_the_wait_after_the_gradients_are_ready(tmp_path):
    """Worker 1 sleeps DELAY s before its gradients exist: worker 0, ready
    first, waits about DELAY s in the all-reduce; worker 1 waits almost
    nothing. A timer that covered the whole step, or missed the collective,
    would fail one of the two bounds."""
    run = run_workers("exposed_communication.py", 2, tmp_path,
                      args=[f"--delay={DELAY}"], timeout=180)
    assert_succeeded(run)
    waits = {r["worker_index"]: r["seconds"][1:] for r in run.results}  # after tracing
    print(f"exposed communication per step (s): {waits}")
    assert all(len(w) == 4 for w in waits.values())
    assert statistics.median(waits[0]) > 0.8 * DELAY
    assert statistics.median(waits[1]) < 0.3 * DELAY
    assert min(min(w) for w in waits.values()) >= 0.0
