"""tfscale.Strategy: Keras 3 fit/evaluate/predict with real worker processes."""

import numpy as np
import pytest

from multiworker import assert_succeeded
from multiworker import run_workers

GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One training run each with 1 and 2 workers, same global batch (4
    workers: tests/test_collectives.py's fit runs, bitwise alike)."""
    tmp_path = tmp_path_factory.mktemp("strategy")
    runs = {}
    for num_workers in (1, 2):
        run = run_workers("fit_worker.py", num_workers, tmp_path,
                          args=[f"--global_batch={GLOBAL_BATCH}"])
        assert_succeeded(run)
        runs[num_workers] = run.results
    return runs


def flat(weights):
    return np.concatenate([np.asarray(w, np.float32) for w in weights])


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [2])
def test_workers_end_with_bitwise_identical_weights(runs, num_workers):
    results = runs[num_workers]
    assert [r["worker_index"] for r in results] == list(range(num_workers))
    assert all(r["num_workers"] == num_workers for r in results)
    for result in results[1:]:
        np.testing.assert_array_equal(flat(result["weights"]),
                                      flat(results[0]["weights"]))


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [2])
def test_n_workers_match_one_worker_with_the_same_global_batch(runs, num_workers):
    one = flat(runs[1][0]["weights"])
    many = flat(runs[num_workers][0]["weights"])
    # Same examples in every global batch; only the summation order differs.
    np.testing.assert_allclose(many, one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runs[num_workers][0]["loss"], runs[1][0]["loss"],
                               rtol=1e-5)


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [1, 2])
def test_evaluate_and_predict_agree_with_one_worker(runs, num_workers):
    for result in runs[num_workers]:
        np.testing.assert_allclose(result["evaluation"], runs[1][0]["evaluation"],
                                   rtol=1e-5)
        np.testing.assert_allclose(result["predictions"], runs[1][0]["predictions"],
                                   rtol=1e-4, atol=1e-5)
        assert len(result["predictions"]) == 96


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [2])
def test_gradients_are_routed_through_tfscale_cross_device_ops(runs, num_workers):
    # The gradient all-reduce is one batch holding every trainable variable's
    # gradient; if Keras stopped routing it through tfscale's CrossDeviceOps
    # (a private hook), this batch would be missing.
    for result in runs[num_workers]:
        assert result["num_trainable"] in result["routed_batch_sizes"]


@pytest.mark.multiworker
def test_one_worker_needs_no_all_reduce(runs):
    # TensorFlow short-cuts reduces over a single replica.
    assert runs[1][0]["routed_batch_sizes"] == []



@pytest.fixture(scope="module")
def three_strategies(tmp_path_factory):
    run = run_workers("strategies_in_one_process.py", 2,
                      tmp_path_factory.mktemp("three_strategies"))
    assert_succeeded(run)
    return run.results


@pytest.mark.multiworker
def test_several_strategies_train_in_one_process(three_strategies):
    for name in ("stock", "default", "untimed"):
        first, second = (r[name]["weights"] for r in three_strategies)
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, b)
    # Dense(7) under the third strategy: shapes no earlier strategy used.
    assert len(three_strategies[0]["untimed"]["weights"][0]) == 5 * 7


@pytest.mark.multiworker
def test_tfscale_all_reduce_trains_like_tensorflows_own(three_strategies):
    result = three_strategies[0]
    for stock, ours in zip(result["stock"]["weights"], result["default"]["weights"],
                           strict=True):
        np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-6)
    assert result["default"]["batch_sizes"], "tfscale's all-reduce was not used"


@pytest.mark.multiworker
def test_stock_strategy_times_its_all_reduces(three_strategies):
    for result in three_strategies:
        assert result["stock"]["exposed"] > 0
        assert result["default"]["exposed"] > 0
        assert result["untimed"]["exposed"] is None


@pytest.mark.multiworker
def test_a_later_strategy_waits_for_a_peer_past_the_collective_timeout(three_strategies):
    # Worker 1 came to its fourth strategy 4 s late; worker 0 waited at the
    # start barrier instead of failing after the 1-s collective timeout.
    assert three_strategies[0]["late_peer_wait_seconds"] > 1, three_strategies


def test_an_evaluator_task_is_refused_before_anything_starts(monkeypatch):
    import json

    import tfscale

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]},
        "task": {"type": "evaluator", "index": 0}}))
    with pytest.raises(ValueError, match="This process is an `evaluator` task of "
                       "its cluster, which takes no part in training"):
        tfscale.Strategy()


def test_a_custom_loop_runs_tfscales_reduce_as_written_not_converted_by_autograph():
    """TensorFlow's custom-training-loop tutorial calls `strategy.reduce` in
    its `tf.function`, which autograph converts; what it calls of tfscale
    runs as written (`graph_order.trace_unconverted`), as TensorFlow's own
    code does, not converted again at every trace."""
    import sys

    import tensorflow as tf

    import tfscale

    strategy = tfscale.Strategy()

    @tf.function
    def train_step(x):
        per_replica = strategy.run(lambda v: v * 2.0, args=(x,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    called = []

    def profile(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        result = train_step(tf.constant(3.0))
    finally:
        sys.setprofile(None)
    assert float(result) == 6.0
    assert "tf__train_step" in called  # the user's function: converted
    assert "reduce_one" in called and "tf__reduce" not in called, sorted(
        name for name in set(called) if name.startswith("tf__"))
