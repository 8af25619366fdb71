"""TensorFlow's heartbeats given time to be answered (Strategy's
`heartbeat_timeout_seconds`): a chief stopped for 12 s, as a heartbeat reply
held up behind a saturated link looks to the others, stops the job under
TensorFlow's own 10 s and not under tfscale's default."""

import pytest

import multiworker

PAUSE = 12  # seconds: more than TensorFlow's 5 s per heartbeat, less than 30


@pytest.mark.parametrize("value", [0, 0.5, None, "60", float("inf"), float("nan")])
def test_heartbeat_timeout_must_be_at_least_a_second(value):
    import tfscale

    with pytest.raises(ValueError, match=r"Argument `heartbeat_timeout_seconds` must be "
                       r"a number of seconds >= 1. Received: heartbeat_timeout_seconds="):
        tfscale.Strategy(heartbeat_timeout_seconds=value)


@pytest.mark.multiworker
def test_a_chief_stopped_for_12_s_does_not_stop_the_job_under_the_default(tmp_path):
    run = multiworker.launch_workers("paused_chief.py", 2, tmp_path,
        why='stops the chief with SIGSTOP; the heartbeat timeout is set once per process',
                                  args=[f"--pause={PAUSE}"], timeout=240)
    multiworker.assert_succeeded(run)
    chief, worker = run.results
    assert chief["stopped_seconds"] >= PAUSE - 1, chief  # the stop happened
    assert chief["second_fit"] == worker["second_fit"] == "trained", run.results
    # Worker 1's second fit waited for the stopped chief.
    assert worker["second_fit_seconds"] >= PAUSE - 2, worker


@pytest.mark.multiworker
def test_the_same_stop_stops_the_job_under_a_10_s_timeout(tmp_path):
    # TensorFlow's default value, set through the option: each heartbeat has
    # 5 s, and worker 1's, sent to the stopped chief, runs out. The stop is
    # one heartbeats notice, so the test above passes by the default it sets
    # (it failed with the default not applied).
    run = multiworker.launch_workers("paused_chief.py", 2, tmp_path,
        why='stops the chief with SIGSTOP; the heartbeat timeout is set once per process',
                                  args=[f"--pause={PAUSE}", "--heartbeat_timeout=10"],
                                  timeout=240)
    assert run.returncode != 0, run.output[-6000:]
    worker = run.results[1]  # reported before exiting 1
    assert worker is not None, run.output[-6000:]
    assert "CoordinationService/Heartbeat" in worker["second_fit"], worker


@pytest.mark.multiworker  # starts one Python interpreter
def test_a_strategy_that_fails_to_build_leaves_no_coordination_service_configured(tmp_path):
    # MWMS refuses its options after tfscale configured the service: the
    # configuration is undone, so that the next strategy of the process
    # waits for its peers as a first one does (`cluster_connected`).
    import json
    import socket
    import sys

    from tfscale.launch import ports

    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen()
    own_port, = ports.free_ports("127.0.0.1", 1)
    tf_config = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{own_port}",
                               f"127.0.0.1:{peer.getsockname()[1]}"]},
        "task": {"type": "worker", "index": 0}})
    script = (
        "from tfscale._private import tf_collectives\n"
        "from tfscale.strategy import KerasMultiWorkerMirroredStrategy\n"
        "try:\n"
        "    KerasMultiWorkerMirroredStrategy(communication_options='not options')\n"
        "except ValueError as error:\n"
        "    print('refused:', error)\n"
        "print('configured after:', tf_collectives.cluster_connected())\n")
    try:
        (tmp_path / "build.py").write_text(script)
        done = multiworker.run([sys.executable, str(tmp_path / "build.py")], tmp_path,
                               multiworker.worker_env(tmp_path, {"TF_CONFIG": tf_config}),
                               timeout=120)
    finally:
        peer.close()
    assert "refused: communication_options must be an instance" in done.stdout, done.stdout[-3000:]
    assert "configured after: False" in done.stdout, done.stdout[-3000:]
