"""The flight recorder (tfscale.collectives.flight_recorder): on real
workers that go wrong, each waiting worker reports the step and bucket it
waits in, and tfscale-launch names the worker behind."""

import json
import re

import pytest

from multiworker import launch_workers
from tfscale import flight_report

# The first collective of a step: the examples of each worker's batch.
# Why these tests start their own workers.
TIMES_OUT = ("collectives time out on purpose, which ends TensorFlow's "
             "collective executor for good")

# A worker blocked in a collective cannot act on the launcher's SIGTERM; it
# reports when its 10 s collective timeout fires. The launcher's grace
# before SIGKILL is longer than that whole timeout, so that report always
# comes (and a stopped worker, which ignores SIGTERM, holds the job no longer).
LAUNCHER = ["--grace_seconds=15"]

COUNTS = "examples per worker (ring; float32 x 3), all_reduce on group 1 of {} workers"


@pytest.mark.multiworker
def test_a_stopped_worker_is_named_and_the_others_say_where_they_wait(tmp_path):
    dumps = tmp_path / "flight"
    run = launch_workers("flight_worker.py", 3, tmp_path, why=TIMES_OUT, launcher_args=LAUNCHER,
                         args=["stop"], timeout=240,
                         env={"TFSCALE_FLIGHT_RECORDER": str(dumps)})
    assert run.returncode != 0
    for worker in (0, 2):
        lines = [l for l in run.output.splitlines() if l.startswith(f"[worker {worker}] ")]
        text = "\n".join(lines)
        assert "tfscale flight recorder, worker" in text, run.output[-5000:]
        assert re.search(r"waits [0-9.]+ s in step 3, " + re.escape(COUNTS.format(3)),
                         text), text[-3000:]
        assert "  last completed: " in text, text[-3000:]
        # TFSCALE_FLIGHT_RECORDER: every record, as JSON.
        records = json.loads((dumps / f"worker-{worker}.json").read_text())["records"]
        gradients = [r for r in records if r.get("purpose") == "gradients"]
        assert {r["step"] for r in gradients} == {0, 1, 2}, gradients
        # A bucket per tensor (no fusion), the last layer's first, named.
        assert {(r["bucket"], r["buckets"]) for r in gradients} == {
            (b, 4) for b in range(4)}
        variables = {r["bucket"]: r["variables"] for r in gradients}
        assert variables == {0: "sequential/dense_1/bias", 1: "sequential/dense_1/kernel",
                             2: "sequential/dense/bias", 3: "sequential/dense/kernel"}
        assert all(r["completed"] for r in gradients)
        assert [r["step"] for r in records if not r["completed"]] == [3]
    summary = [l for l in run.output.splitlines()
               if l.startswith("tfscale-launch: flight recorder: ")]
    assert summary, run.output[-5000:]
    assert ("workers 0, 2 wait in step 3 (examples per worker) (ring, float32 x 3)"
            in summary[0]
            and "worker 1 sent no report" in summary[0]), summary


@pytest.mark.multiworker
def test_a_worker_one_step_ahead_is_named_at_that_step(tmp_path):
    run = launch_workers("flight_worker.py", 2, tmp_path, why=TIMES_OUT, launcher_args=LAUNCHER,
                         args=["extra_step"], timeout=240)
    assert run.returncode != 0
    text = "\n".join(l for l in run.output.splitlines() if l.startswith("[worker 0] "))
    assert re.search(r"waits [0-9.]+ s in step 4, " + re.escape(COUNTS.format(2)),
                     text), run.output[-5000:]
    (summary,) = [l for l in run.output.splitlines()
                  if l.startswith("tfscale-launch: flight recorder: ")]
    assert "worker 0 waits in step 4 (examples per worker)" in summary, summary
    # Worker 1 ended its fit: it finished, or waits outside any step.
    assert ("worker 1 finished (exit 0)" in summary
            or "worker 1 waits in outside a training step" in summary), summary


@pytest.mark.multiworker
def test_workers_with_other_trainable_variables_are_told_which_bucket_differs(tmp_path):
    # Worker 1 froze the last layer: the first gradient bucket (no fusion) is
    # the last layer's bias (2 floats) on worker 0, the first layer's bias
    # (16) on worker 1; TensorFlow refuses the collective.
    run = launch_workers("flight_worker.py", 2, tmp_path, why=TIMES_OUT, launcher_args=LAUNCHER,
                         args=["frozen_layer"], timeout=240)
    assert run.returncode != 0
    expected = {0: "gradient bucket 0 of 4 (ring; float32 x 2; variables "
                   "sequential/dense_1/bias)",
                1: "gradient bucket 0 of 2 (ring; float32 x 16; variables "
                   "sequential/dense/bias)"}
    quotes = 0
    for worker, bucket in expected.items():
        text = "\n".join(l for l in run.output.splitlines()
                         if l.startswith(f"[worker {worker}] "))
        assert re.search(r"waits [0-9.]+ s in step 0, " + re.escape(bucket), text), (
            run.output[-5000:])
        quotes += bool(re.search(
            r"collective instance \d+: worker \d brought shape \[(2|16)\], another "
            r"worker \[(16|2)\] \(TensorFlow's error\): the workers built different "
            r"models, or different variables are trainable", text))
    assert quotes, run.output[-5000:]  # where TensorFlow's error says so


@pytest.mark.multiworker
def test_a_worker_that_builds_another_model_is_told_which_variable(tmp_path):
    # Worker 1's first layer has 17 units: the chief's broadcast of the first
    # variable's initial value (MWMS's) brings [8, 16] to its [8, 17].
    run = launch_workers("flight_worker.py", 2, tmp_path, why=TIMES_OUT, launcher_args=LAUNCHER,
                         args=["other_model"], timeout=240)
    assert run.returncode != 0
    said = re.findall(r"WorkersDisagreeError: (Worker \d could not create its variable "
                      r"1 \('kernel'\) together with the other workers \([^\n]*)",
                      run.output)
    assert said, run.output[-5000:]
    assert all(s.endswith("Every worker must build the same model under the "
                          "strategy's scope: the same layers, with the same shapes, "
                          "created in the same order.") for s in said), said
    assert any("17" in s and "16" in s for s in said), said  # both shapes, quoted


def test_tensorflow_s_shape_mismatch_is_quoted():
    message = ("INTERNAL: Shape mismatch in the collective instance 113. Op at device "
               "/job:worker/replica:0/task:2/device:CPU:0 expected shape [4320] but "
               "another member in the group expected shape [4754]. This is likely")
    assert flight_report.peer_mismatch(message) == (
        "collective instance 113: worker 2 brought shape [4320], another worker "
        "[4754] (TensorFlow's error): the workers built different models, or "
        "different variables are trainable")
    assert flight_report.peer_mismatch("Deadline Exceeded") is None
    # tfscale-train names the cause, not "Lost contact with a peer worker".
    import tensorflow as tf
    from tfscale.launch import training

    said = training.describe_failure(None, tf.errors.InternalError(None, None, message))
    assert said.startswith("The workers issued different collectives: collective "
                           "instance 113: worker 2 brought shape [4320]"), said


def test_the_summary_names_who_waits_and_who_is_behind():
    waiting = {"step": 7, "purpose": "gradients", "bucket": 3, "buckets": 4,
               "algorithm": "ring", "dtype": "float32", "elements": 4754}
    done = {"step": 7, "purpose": "gradients", "bucket": 0, "buckets": 4}
    positions = {0: {"pending": waiting}, 1: {"pending": waiting},
                 2: {"pending": None, "completed": done}}
    assert flight_report.summarize(positions, 5, finished={3}) == (
        "workers 0, 1 wait in step 7 (gradient bucket 3 of 4) (ring, float32 x 4754); "
        "worker 2 is at step 7 (gradient bucket 0 of 4) (last completed, nothing "
        "pending); worker 3 finished (exit 0); worker 4 sent no report (stopped, "
        "killed or hung outside a collective)")
    assert flight_report.describe(dict(waiting, op="all_reduce", group=1, group_size=3,
                                       variables="d/kernel .. d/bias")) == (
        "step 7, gradient bucket 3 of 4 (ring; float32 x 4754; variables d/kernel .. "
        "d/bias), all_reduce on group 1 of 3 workers")
    line = "[worker 1] " + flight_report.LINE_PREFIX + '{"worker": 1, "pending": null}'
    assert flight_report.parse(line) == {"worker": 1, "pending": None}
    assert flight_report.parse("tfscale-flight {not json") is None


def test_the_pending_collective_reported_is_the_first_traced_of_the_oldest_step():
    # Sequence numbers count collectives as their inputs become ready: a
    # scalar all-reduce traced after a gradient bucket on the same group is
    # counted first, yet waits behind the bucket (one group runs its
    # collectives in the order traced). The bucket is what every worker waits on.
    import tensorflow as tf
    from tfscale.collectives import flight_recorder

    recorder = flight_recorder.FlightRecorder("/CPU:0", worker=0)
    with recorder.context(step=tf.constant(4), purpose="gradients", bucket=0, buckets=2):
        bucket_site = recorder.site({"op": "all_reduce"})[0]
    scalar_site = recorder.site({"op": "all_reduce", "elements": 1})[0]
    step_site = recorder.site({"op": "all_reduce", "purpose": "examples per worker"})[0]
    rows = [(1, step_site, 4.0, True), (2, scalar_site, -1.0, False),
            (3, bucket_site, 4.0, False)]
    for sequence, site, step, completed in rows:
        recorder.rows.scatter_nd_update([[sequence - 1]], [[site, step, sequence, 100.0]])
        if completed:
            recorder.completed(tf.constant(sequence, tf.int64))
    position = recorder.position()
    assert position["pending"]["site"] == bucket_site, position
    assert position["pending"]["step"] == 4 and position["pending"]["bucket"] == 0
    assert position["completed"]["sequence"] == 1
