"""tfscale.callbacks.StragglerReport: who holds a synchronous job back."""

import glob
import logging
import re
import time

import pytest
import tensorflow as tf

from multiworker import assert_succeeded
from multiworker import run_workers
from tfscale.callbacks import StragglerReport
from tfscale.callbacks import straggler_report

NAMES = ["worker 0 (a:1)", "worker 1 (b:1)", "worker 2 (c:1)", "worker 3 (d:1)"]


def test_find_stragglers_names_workers_over_the_threshold_only():
    assert straggler_report.find_stragglers([0.05, 0.081, 0.052], 0.2) == [
        (1, pytest.approx(0.081 / 0.052))]
    assert straggler_report.find_stragglers([0.05, 0.06, 0.052], 0.2) == []  # 15%
    assert straggler_report.find_stragglers([1.0, 1.0, 1.0], 0.0) == []
    assert straggler_report.find_stragglers([0.1], 0.2) == []
    assert straggler_report.find_stragglers([0.0, 0.0, 1.0], 0.2) == []  # median 0


def test_describe_names_the_straggler_and_its_address():
    assert straggler_report.describe(3, [0.052, 0.081, 0.05], NAMES, 0.2) == (
        "Compute per step (median, epoch 3): worker 0 0.052 s, worker 1 0.081 s, "
        "worker 2 0.05 s; worker 1 (b:1) is 56% slower than the median "
        "(0.052 s): it holds the job back.")


def test_describe_names_several_stragglers():
    assert straggler_report.describe(1, [0.1, 0.2, 0.1, 0.3], NAMES, 0.2) == (
        "Compute per step (median, epoch 1): worker 0 0.1 s, worker 1 0.2 s, "
        "worker 2 0.1 s, worker 3 0.3 s; worker 1 (b:1) is 33% slower, "
        "worker 3 (d:1) is 100% slower than the median (0.15 s): they hold the "
        "job back.")


def test_describe_says_when_nobody_is_slow():
    assert straggler_report.describe(2, [0.05, 0.055, 0.06], NAMES, 0.2) == (
        "Compute per step (median, epoch 2): worker 0 0.05 s, worker 1 0.055 s, "
        "worker 2 0.06 s; no worker is more than 20% slower than the median "
        "(0.055 s).")
    assert straggler_report.describe(1, [0.05], ["worker 0"], 0.2) == (
        "Compute per step (median, epoch 1): worker 0 0.05 s.")


def test_worker_names_carry_the_tf_config_task_and_address():
    assert straggler_report.worker_names({}) == ["worker 0"]
    assert straggler_report.worker_names({"worker": ["h0:1", "h1:1"]}) == [
        "worker 0 (h0:1)", "worker 1 (h1:1)"]
    assert straggler_report.worker_names(
        {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]}) == [
        "worker 0 (chief:0, c:1)", "worker 1 (worker:0, w0:1)",
        "worker 2 (worker:1, w1:1)"]


def test_a_strategy_without_all_reduce_timing_is_refused():
    with pytest.raises(ValueError, match=re.escape(
            "StragglerReport needs a strategy that times its all-reduces")):
        StragglerReport(tf.distribute.get_strategy())


def test_one_worker_reports_its_compute_per_step_with_steps_per_execution(
        tmp_path, caplog):
    """A sleep before each call of 2 steps (steps_per_execution) adds half of
    it to each step's compute: the report divides by the steps a call runs.
    Logged on the chief (the only worker) and written for TensorBoard."""
    import keras
    import numpy as np

    import tfscale

    sleep = 0.1
    strategy = tfscale.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse",
                      steps_per_execution=2)
    callback = StragglerReport(strategy, log_dir=str(tmp_path))
    sleeper = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: time.sleep(sleep))
    with caplog.at_level(logging.INFO, logger="absl"):
        model.fit(np.ones((48, 4), "float32"), np.zeros((48, 2), "float32"),
                  batch_size=8, epochs=1, verbose=0, callbacks=[sleeper, callback])
    [seconds] = callback.compute_seconds
    assert sleep / 2 < seconds < sleep, seconds  # 3 calls of 2 steps
    assert callback.stragglers == []
    assert f"Compute per step (median, epoch 1): worker 0 {seconds:.3g} s." in caplog.text
    tags = {}
    for path in glob.glob(str(tmp_path / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags[value.tag] = (event.step, float(tf.make_ndarray(value.tensor)))
    assert tags == {"straggler/worker_0_compute_seconds": (6, pytest.approx(seconds)),
                    "straggler/slowest_over_median": (6, 1.0)}


# Steps of this tiny model take ~3 ms; on a busy 2-core machine unslowed
# workers' medians differ by tens of percent, so the multi-worker test names
# at 500% (the 20% default's decision is unit-tested above). Worker SLOW's
# sleep makes it ~60x slower; the others' compute stays far below DELAY / 2
# unless their wait for it were counted.
SLOW, DELAY, THRESHOLD = 1, 0.2, 5.0


@pytest.mark.multiworker
def test_the_worker_slowed_on_purpose_is_named_and_no_other(tmp_path):
    """3 workers; worker SLOW sleeps DELAY s before each step of epoch 1 (the
    others wait for it inside their all-reduces), nobody in epoch 2. The
    chief names worker SLOW, by index and address, in epoch 1 only; the
    others' compute leaves out their wait; every worker gathered the same
    medians."""
    run = run_workers("straggler_worker.py", 3, tmp_path, timeout=180, args=[
        f"--slow_worker={SLOW}", f"--delay={DELAY}", f"--threshold={THRESHOLD}"])
    assert_succeeded(run)
    lines = re.findall(r"^\[worker (\d)\].*(Compute per step .*)$", run.output, re.M)
    print("\n".join(line for _, line in lines))
    assert [worker for worker, _ in lines] == ["0", "0"]  # the chief, per epoch
    first, second = (line for _, line in lines)
    assert re.search(rf"; worker {SLOW} \(127\.0\.0\.1:\d+\) is \d+% slower than "
                     r"the median \([0-9.e-]+ s\): it holds the job back\.$", first)
    assert "; no worker is more than 500% slower than the median (" in second
    epochs = [result["epochs"] for result in run.results]
    assert all(e == epochs[0] for e in epochs)  # the same gathered values everywhere
    assert [e["stragglers"] for e in epochs[0]] == [[SLOW], []]
    compute = [e["compute_seconds"] for e in epochs[0]]
    assert compute[0][SLOW] > DELAY
    assert all(s < DELAY / 2 for i, s in enumerate(compute[0]) if i != SLOW)
    assert all(s < DELAY / 2 for s in compute[1])
