"""Keras's `steps_per_execution` with real workers.

Keras runs `steps_per_execution > 1` steps in a `tf.while_loop`; stock
MultiWorkerMirroredStrategy fails there with 2+ workers (`You must feed a
value for placeholder tensor 'while/cond/Placeholder'`: the collectives'
call-time instance key is never fed inside the loop). tfscale's strategies
give those collectives an instance key fixed when traced
(tfscale/_private/tf_collectives.py, `_LoopSafeLauncher`).
"""

import numpy as np
import pytest
import tensorflow as tf

from multiworker import assert_succeeded
from multiworker import run_workers

NUM_WORKERS = 2
STEPS_PER_EXECUTION = 4
# (input, optimizer steps in 2 epochs): 8 steps an epoch from the infinite
# pipeline; 96 examples / global batch 16 = 6 steps an epoch from numpy.
RUNS = (("distributed", 16), ("numpy", 12))


@pytest.fixture(scope="module", params=["tfscale", "stock"])
def results(request, tmp_path_factory):
    run = run_workers(
        "steps_per_execution_worker.py", NUM_WORKERS,
        tmp_path_factory.mktemp(f"steps_{request.param}"),
        args=[f"--strategy={request.param}",
              f"--steps_per_execution={STEPS_PER_EXECUTION}"],
    )
    assert_succeeded(run)
    assert [r["worker_index"] for r in run.results] == list(range(NUM_WORKERS))
    assert all(r["num_workers"] == NUM_WORKERS for r in run.results)
    return [r["results"] for r in run.results]


def flat(weights):
    return np.concatenate([np.asarray(w, np.float32) for w in weights])


@pytest.mark.multiworker
@pytest.mark.parametrize("data,steps", RUNS)
def test_every_step_runs(results, data, steps):
    for result in results:
        assert result[f"{data}/1"]["iterations"] == steps
        assert result[f"{data}/{STEPS_PER_EXECUTION}"]["iterations"] == steps


@pytest.mark.multiworker
@pytest.mark.parametrize("data,steps", RUNS)
def test_workers_end_with_bitwise_identical_weights(results, data, steps):
    for spe in (1, STEPS_PER_EXECUTION):
        key = f"{data}/{spe}"
        for result in results[1:]:
            np.testing.assert_array_equal(flat(result[key]["weights"]),
                                          flat(results[0][key]["weights"]))
            assert result[key]["evaluation"] == results[0][key]["evaluation"]


@pytest.mark.multiworker
@pytest.mark.parametrize("data,steps", RUNS)
def test_steps_per_execution_gives_the_weights_of_one_step_per_execution(
        results, data, steps):
    # Bitwise: each step runs the same traced one-step function on the same
    # batch, with the same all-reduce; only how often Python calls in changes.
    for result in results:
        many = result[f"{data}/{STEPS_PER_EXECUTION}"]
        one = result[f"{data}/1"]
        np.testing.assert_array_equal(flat(many["weights"]), flat(one["weights"]))
        assert many["loss"] == one["loss"]
        assert many["accuracy"] == one["accuracy"]
        assert many["evaluation"] == one["evaluation"]


@pytest.mark.multiworker
@pytest.mark.parametrize("data,steps", RUNS)
def test_loop_instance_keys_are_fixed_at_trace_time(results, data, steps):
    # The hook in tfscale/_private/tf_collectives.py (`_LoopSafeLauncher`) is what makes
    # the loop work; if TensorFlow stopped calling it these lists would be
    # empty (and fit would fail as stock MWMS does).
    for result in results:
        assert result[f"{data}/1"]["loop_instance_keys"] == []
        assert result[f"{data}/{STEPS_PER_EXECUTION}"]["loop_instance_keys"]
    for result in results[1:]:
        key = f"{data}/{STEPS_PER_EXECUTION}"
        assert result[key]["loop_instance_keys"] == results[0][key]["loop_instance_keys"]


def test_tensorflow_never_feeds_a_call_time_capture_inside_a_loop():
    """The root cause, in one process and without collectives: a value that a
    nested `tf.function` captures at call time (as TensorFlow's collectives
    capture their instance keys) is fed when the function is called directly,
    and never when it is called inside `tf.while_loop` -> `tf.cond`, as
    Keras's `multi_step_on_iterator` calls its one-step function. When this
    test fails, TensorFlow has fixed it and `_LoopSafeLauncher` can go."""
    calls = []

    def call_time_value():
        calls.append(None)
        return tf.constant(len(calls))

    @tf.function
    def one_step(x):
        graph = tf.compat.v1.get_default_graph()
        return x + graph.capture_call_time_value(
            call_time_value, tf.TensorSpec([], tf.int32))

    @tf.function
    def direct(x):
        return one_step(x)

    @tf.function
    def in_loop(x):
        return tf.while_loop(
            lambda i, y: i < 2,
            lambda i, y: (i + 1, tf.cond(i >= 0, lambda: one_step(y), lambda: y)),
            [0, x])[1]

    assert int(direct(tf.constant(0))) == 1
    assert int(direct(tf.constant(0))) == 2
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="You must feed a value for placeholder tensor "
                             "'.*while/cond/Placeholder'"):
        in_loop(tf.constant(0))
