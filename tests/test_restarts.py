"""launch.restarts: when tfscale-launch relaunches, and which slots it drops.

No processes: the policy is fed failures as the launcher would report them.
"""

import re
import signal

import pytest

from tfscale.launch import restarts
from tfscale.launch.restarts import RestartPolicy
from tfscale.launch.restarts import WorkerFailure


def failure(slot, seconds=1.0, code=3, index=None):
    return WorkerFailure(index=slot if index is None else index, slot=slot,
                         code=code, seconds=seconds)


def test_without_max_restarts_the_first_failure_ends_the_run():
    policy = RestartPolicy(2)
    decision = policy.after_failure(failure(1))
    assert not decision.restart and decision.dropped_slot is None
    assert decision.message == "worker 1 exited with code 3; stopped the other workers."
    assert failure(1).exit_code == 3


def test_restarts_are_counted_and_run_out():
    policy = RestartPolicy(2, max_restarts=2)
    messages = [policy.after_failure(failure(0, code=-signal.SIGKILL)).message
                for _ in range(3)]
    assert messages == [
        "worker 0 was killed by SIGKILL; stopped the other workers; restart 1 of 2 "
        "on fresh ports.",
        "worker 0 was killed by SIGKILL; stopped the other workers; restart 2 of 2 "
        "on fresh ports.",
        "worker 0 was killed by SIGKILL; stopped the other workers; no restart left "
        "(--max_restarts=2).",
    ]
    assert policy.restarts == 2 and policy.slots == [0, 1]
    assert failure(0, code=-signal.SIGKILL).exit_code == 1


def test_a_slot_failing_again_within_the_window_is_dropped_down_to_min_workers():
    policy = RestartPolicy(4, max_restarts=6, min_workers=2, restart_window=60)
    assert policy.after_failure(failure(3, seconds=500)).dropped_slot is None
    dropped = policy.after_failure(failure(3, seconds=3))
    assert dropped.restart and dropped.dropped_slot == 3
    assert dropped.message == (
        "worker 3 exited with code 3; stopped the other workers; dropping worker "
        "slot 3 (failed again 3 s after restart 1); continuing with 3 workers: "
        "restart 2 of 6 on fresh ports.")
    assert policy.slots == [0, 1, 2]
    # Slot 1 fails for the first time, then again at once (as worker 1).
    assert policy.after_failure(failure(1, seconds=2)).dropped_slot is None
    second = policy.after_failure(failure(1, seconds=2))
    assert second.dropped_slot == 1 and policy.slots == [0, 2]
    # Slot 2 now runs as worker 1; at --min_workers it is kept.
    policy.after_failure(failure(2, index=1, seconds=400))
    kept = policy.after_failure(failure(2, index=1, seconds=0.25))
    assert kept.restart and kept.dropped_slot is None and policy.slots == [0, 2]
    assert kept.message == (
        "worker 1 (slot 2) exited with code 3; stopped the other workers; worker "
        "slot 2 failed again 0.25 s after restart 5, but --min_workers=2 keeps "
        "it; restart 6 of 6 on fresh ports.")


def test_only_a_slot_that_failed_before_and_only_after_a_restart_is_dropped():
    policy = RestartPolicy(3, max_restarts=3, min_workers=1, restart_window=60)
    # A quick first failure is no reason to drop: there was no restart.
    assert policy.after_failure(failure(0, seconds=1)).dropped_slot is None
    # Another slot failing quickly after the restart had not failed before.
    assert policy.after_failure(failure(2, seconds=1)).dropped_slot is None
    # Slot 0 again, but later than the window: kept.
    assert policy.after_failure(failure(0, seconds=61)).dropped_slot is None
    assert policy.slots == [0, 1, 2]


def test_a_preempted_slot_is_relaunched_and_never_dropped():
    policy = RestartPolicy(3, max_restarts=3, min_workers=1, restart_window=60)
    first = policy.after_failure(failure(1, code=143, seconds=1))
    assert first.message == (
        "worker 1 was preempted (exit code 143: a SIGTERM, after every worker "
        "saved the same step); stopped the other workers; restart 1 of 3 on "
        "fresh ports.")
    # Preempted again right after the relaunch: a busy cluster, not a broken
    # machine.
    again = policy.after_failure(failure(1, code=143, seconds=1))
    assert again.restart and again.dropped_slot is None
    assert policy.slots == [0, 1, 2] and policy.restarts == 2
    # A real failure after a preemption is the slot's first.
    assert policy.after_failure(failure(1, code=1, seconds=1)).dropped_slot is None


def test_without_min_workers_no_slot_is_ever_dropped():
    policy = RestartPolicy(3, max_restarts=3)
    for _ in range(3):
        decision = policy.after_failure(failure(1, seconds=0.1))
        assert decision.restart and decision.dropped_slot is None
        assert "min_workers" not in decision.message
    assert policy.slots == [0, 1, 2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_restarts=-1), "--max_restarts=-1: must be >= 0"),
    (dict(max_restarts=1, min_workers=0), "--min_workers=0: must be between 1 and "
     "--num_workers=3"),
    (dict(max_restarts=1, min_workers=4), "--min_workers=4: must be between 1"),
    (dict(min_workers=2), "--min_workers=2 drops worker slots only when "
     "relaunching them: give --max_restarts >= 1 as well"),
    (dict(max_restarts=1, restart_window=-1), "--restart_window=-1: must be >= 0"),
])
def test_inconsistent_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RestartPolicy(3, **kwargs)


def test_the_launcher_reads_the_code_workers_exit_with_when_preempted():
    from tfscale import preemption  # TensorFlow: the launcher keeps its own copy

    assert restarts.PREEMPTED_EXIT_CODE == preemption.PREEMPTED_EXIT_CODE == 143
