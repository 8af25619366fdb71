"""TensorFlow's heartbeats given time to be answered (Strategy's
`heartbeat_timeout_seconds`): a chief stopped for 12 s, as a heartbeat reply
held up behind a saturated link looks to the others, stops the job under
TensorFlow's own 10 s and not under tfscale's default."""

import pytest

import multiworker

PAUSE = 12  # seconds: more than TensorFlow's 5 s per heartbeat, less than 30


@pytest.mark.parametrize("value", [0, 0.5, None, "60"])
def test_heartbeat_timeout_must_be_at_least_a_second(value):
    import tfscale

    with pytest.raises(ValueError, match=r"Argument `heartbeat_timeout_seconds` must be "
                       r"a number of seconds >= 1. Received: heartbeat_timeout_seconds="):
        tfscale.Strategy(heartbeat_timeout_seconds=value)


@pytest.mark.multiworker
def test_a_chief_stopped_for_12_s_does_not_stop_the_job_under_the_default(tmp_path):
    run = multiworker.run_workers("paused_chief.py", 2, tmp_path,
                                  args=[f"--pause={PAUSE}"], timeout=240)
    multiworker.assert_succeeded(run)
    chief, worker = run.results
    assert chief["paused_seconds"] >= PAUSE, chief
    assert chief["second_fit"] == worker["second_fit"] == "trained", run.results
    # Worker 1's second fit waited for the stopped chief.
    assert worker["second_fit_seconds"] >= PAUSE - 2, worker


@pytest.mark.multiworker
def test_the_same_stop_stops_the_job_under_tensorflows_own_10_s(tmp_path):
    # Each heartbeat then has 5 s, and worker 1's, sent to the stopped chief,
    # runs out: the stop is one heartbeats notice, so the test above passes
    # by the default it sets (it failed with the default not applied).
    run = multiworker.run_workers("paused_chief.py", 2, tmp_path,
                                  args=[f"--pause={PAUSE}", "--heartbeat_timeout=10"],
                                  timeout=240)
    assert run.returncode != 0, run.output[-6000:]
    worker = run.results[1]  # reported before exiting 1
    assert worker is not None, run.output[-6000:]
    assert "CoordinationService/Heartbeat" in worker["second_fit"], worker
