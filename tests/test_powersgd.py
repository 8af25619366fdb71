"""PowerSGD (tfscale.collectives.powersgd): the algorithm against a float64
NumPy reference, its plan, and training with it under tfscale.Strategy.

Both 2-worker tests check one run of 2 real workers
(tests/workers/powersgd_fit.py): the reference test what its first phase
reports (`PowerSGD.all_reduce` on known gradients, summing through
`strategy.collective_group`), the other its trainings.
"""

import os

import numpy as np
import pytest

import keras
import tensorflow as tf

import tfscale
from tfscale.collectives import powersgd
from tests import multiworker


def test_plan_compresses_matrices_that_shrink_enough():
    shapes = [(3, 3, 16, 32), (32,), (4, 4), (64, 10), (5, 7)]
    dtypes = ["float32", "float32", "float32", "float32", "float16"]
    matrices = powersgd.plan(shapes, dtypes, rank=4)
    # conv kernel -> (3*3*16) x 32; (4 + 4) * 4 * 2 > 16 stays; (64 + 10) *
    # 4 * 2 = 592 < 640 compressed; float16 stays.
    assert [(m.index, m.rows, m.cols, m.rank) for m in matrices] == [
        (0, 144, 32, 4), (3, 64, 10, 4)]
    assert matrices[0].compressed_bytes == (144 + 32) * 4 * 4
    text = powersgd.describe(matrices, shapes, dtypes)
    assert ("tensor 0 [3, 3, 16, 32]: 18,432 bytes -> 144x32 at rank 4: 2,816 "
            "bytes (P 144x4 + Q 32x4, 6.5x)") in text
    assert "tensor 1 [32]: 128 bytes float32, uncompressed" in text
    assert ("total: 21,254 bytes -> 4,262 bytes on the wire (5.0x smaller), "
            "2 of 5 tensors compressed") in text


def _gram_schmidt(matrix, epsilon=powersgd.EPSILON):
    """PyTorch's `_orthogonalize`, in float64 NumPy."""
    matrix = matrix.copy()
    for i in range(matrix.shape[1]):
        matrix[:, i] /= np.linalg.norm(matrix[:, i]) + epsilon
        for j in range(i + 1, matrix.shape[1]):
            matrix[:, j] -= np.dot(matrix[:, i], matrix[:, j]) * matrix[:, i]
    return matrix


def test_orthogonalize_matches_gram_schmidt():
    matrix = np.random.default_rng(0).normal(size=(9, 3))
    result = powersgd.orthogonalize(tf.constant(matrix, tf.float32)).numpy()
    np.testing.assert_allclose(result, _gram_schmidt(matrix), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.T @ result, np.eye(3), atol=1e-6)
    assert np.all(powersgd.orthogonalize(tf.zeros([4, 2])).numpy() == 0)


@pytest.fixture(scope="module")
def powersgd_fit_run(tmp_path_factory):
    """The one 2-worker run of tests/workers/powersgd_fit.py both 2-worker
    tests check, and its backup directory."""
    tmp_path = tmp_path_factory.mktemp("powersgd_fit")
    backup_dir = tmp_path / "backup"
    run = multiworker.run_workers(
        "powersgd_fit.py", 2, tmp_path,
        args=[f"--backup_dir={backup_dir}", "--steps=6", "--start_step=2",
              "--stop_after=4"], timeout=240)
    multiworker.assert_succeeded(run)
    return run, backup_dir


@pytest.mark.multiworker
def test_two_workers_match_the_numpy_reference_over_several_steps(powersgd_fit_run):
    """P = sum M Q (Q orthogonalized), P orthogonalized, Q = sum M^T P, the
    sum approximated by P Q^T, each worker's error M - P Q^T / 2 added to its
    next gradient, Q warm-started: 6 steps of 2 real workers, each running
    `PowerSGD.all_reduce` with a sum through `strategy.collective_group`,
    compression from the third step (before it: the exact sum, no error
    kept). Outputs bitwise equal on both workers, errors each worker's own."""
    run, _ = powersgd_fit_run
    reported = [result["reference"] for result in run.results]
    # The run's --steps and --start_step, the worker's RANK and
    # REFERENCE_SHAPES, and its draws (REFERENCE_SEED).
    steps, start, rank = 6, 2, 2
    shapes = [(4, 3, 8), (8,), (6, 3)]  # 12x8 compressed; vector; 6x3 too small
    assert reported[0]["shapes"] == [list(s) for s in shapes]
    assert reported[0]["compressed_shapes"] == [[12, 8]]
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(2, steps, sum(np.prod(s) for s in shapes)))
    outputs = [[[np.reshape(o, s) for o, s in zip(step_outputs, shapes)]
                for step_outputs in r["outputs"]] for r in reported]
    errors = [[np.reshape(e, (12, 8)) for e in r["error"]] for r in reported]
    assert all(len(o) == steps for o in outputs)

    def split(flat):
        parts, at = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            parts.append(flat[at:at + size].reshape(shape))
            at += size
        return parts

    matrices = powersgd.plan(shapes, ["float32"] * 3, rank)
    assert [(m.index, m.rows, m.cols) for m in matrices] == [(0, 12, 8)]
    q = tf.random.stateless_normal([8, rank], seed=[powersgd.SEED, 0]).numpy()
    q = q.astype(np.float64)
    error = [np.zeros((12, 8)), np.zeros((12, 8))]
    for step in range(steps):
        parts = [split(grads[w, step]) for w in range(2)]
        exact = [parts[0][i] + parts[1][i] for i in range(3)]
        expected = list(exact)
        if step >= start:
            ms = [parts[w][0].reshape(12, 8) + error[w] for w in range(2)]
            p = _gram_schmidt(sum(m @ _gram_schmidt(q) for m in ms))
            q_sum = sum(m.T @ p for m in ms)
            approximation = p @ q_sum.T
            error = [m - approximation / 2 for m in ms]
            q = q_sum / 2
            expected[0] = approximation.reshape(shapes[0])
            assert np.max(np.abs(approximation - exact[0].reshape(12, 8))) > 0.1
        for w in range(2):
            for got, want in zip(outputs[w][step], expected):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(errors[w][step], error[w], rtol=1e-4, atol=1e-4)
        assert reported[0]["outputs"][step] == reported[1]["outputs"][step]
    assert not np.allclose(errors[0][-1], errors[1][-1])  # each worker's own


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_trains_under_mixed_precision_with_lars(policy):
    """One worker, LARS (in tfscale's LossScaleOptimizer under mixed_float16):
    PowerSGD from the first step trains, keeps its state for the float32
    master weights' gradients, and changes the result against no
    compression."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.integers(0, 4, size=64)
    results = {}
    try:
        keras.mixed_precision.set_global_policy(policy)
        for compression in (None, "powersgd"):
            options = {} if compression is None else dict(
                compression="powersgd",
                powersgd=tfscale.PowerSGDOptions(rank=1, start_step=0))
            strategy = tfscale.Strategy(tfscale.CommunicationOptions(**options))
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = keras.Sequential([
                    keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                    keras.layers.Dense(4),
                    keras.layers.Activation("linear", dtype="float32")])
                model.compile(
                    optimizer=tfscale.optimizers.LARS(learning_rate=5.0, momentum=0.9),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            assert np.all(np.isfinite(history.history["loss"]))
            results[compression] = model.get_weights()[0]
            state = strategy.worker_state(model)
            if compression is None:
                assert state is None
            else:
                assert [(m.rows, m.cols) for m in state.matrices] == [(12, 32), (32, 4)]
                assert np.any(state.error[0].numpy() != 0)
                assert int(model.optimizer.iterations.numpy()) == 8
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert not np.array_equal(results[None], results["powersgd"])


@pytest.mark.multiworker
def test_two_workers_start_step_and_bitwise_resume(powersgd_fit_run):
    """2 workers, LARS, rank 2 from step 3 (start_step=2): weights
    bitwise equal on both workers; the first 2 steps bitwise equal to the
    uncompressed run, the third not; each worker keeps its own error
    feedback; stopped after 4 steps and resumed from the backup of step 3,
    the run ends bitwise equal to the uninterrupted one. Also with gradient
    accumulation and steps_per_execution=2: bitwise equal on both workers,
    error feedback kept, and until PowerSGD starts bitwise the accumulated
    run uncompressed."""
    run, backup_dir = powersgd_fit_run
    chief, other = run.results
    for name in ("uncompressed", "powersgd", "interrupted", "resumed", "accumulated",
                 "accumulated_uncompressed"):
        assert chief[name]["steps"] == other[name]["steps"], name
    plain, compressed = chief["uncompressed"]["steps"], chief["powersgd"]["steps"]
    assert compressed["1"] == plain["1"] and compressed["2"] == plain["2"]
    assert compressed["3"] != plain["3"]
    assert chief["powersgd"]["compressed_shapes"] == [[12, 32]]
    assert chief["powersgd"]["error"] != other["powersgd"]["error"]
    # Stopped in step 4's callbacks; its backup of step 3 is what resumes.
    assert max(int(s) for s in chief["interrupted"]["steps"]) == 3
    assert chief["interrupted"]["steps"]["3"] == compressed["3"]
    resumed = chief["resumed"]["steps"]
    assert min(int(s) for s in resumed) == 3  # restored, not trained from 0
    assert resumed["6"] == compressed["6"]
    assert chief["resumed"]["error"] == chief["powersgd"]["error"]
    assert other["resumed"]["error"] == other["powersgd"]["error"]
    assert not os.path.exists(backup_dir)  # deleted when the fit ended
    # With accumulation and steps_per_execution: 3 updates of 2 micro-batches,
    # compressed from the third: the first two bitwise those of the same
    # accumulated run uncompressed, the third not.
    accumulated = chief["accumulated"]
    assert max(int(s) for s in accumulated["steps"]) == 3
    uncompressed = chief["accumulated_uncompressed"]["steps"]
    assert accumulated["steps"]["1"] == uncompressed["1"]
    assert accumulated["steps"]["2"] == uncompressed["2"]
    assert accumulated["steps"]["3"] != uncompressed["3"]
    assert any(e != 0 for e in accumulated["error"][0])
    assert accumulated["error"] != other["accumulated"]["error"]


def _compiled_model(strategy, seed=0):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_checkpoint_keeps_each_workers_state_and_resets_on_another_count(
        tmp_path, caplog):
    """One worker saves its error feedback and Q beside the chief's
    checkpoint and reads them back; a checkpoint written by 2 workers gives
    a 1-worker run zero error feedback and worker 0's Q (with a warning)."""
    from tfscale import checkpoint

    options = tfscale.CommunicationOptions(
        compression="powersgd", powersgd=tfscale.PowerSGDOptions(rank=2))
    strategy = tfscale.Strategy(options)
    model = _compiled_model(strategy)
    with strategy.scope():
        state = strategy.worker_state(model)
    state.error[0].assign(tf.fill([12, 32], 0.5))
    state.q[0].assign(tf.fill([32, 2], 3.0))
    checkpoint.save(model, tmp_path, 3)
    checkpoint.save_worker_state(model, tmp_path, 3)
    assert os.path.isdir(tmp_path / "worker-state" / "step-000000003" / "worker-0-of-1")

    strategy = tfscale.Strategy(options)
    model = _compiled_model(strategy, seed=1)
    with strategy.scope():
        assert checkpoint.restore(model, tmp_path) == 3
        state = strategy.worker_state(model)
    assert np.all(state.error[0].numpy() == 0.5) and np.all(state.q[0].numpy() == 3.0)

    # As if 2 workers had written step 3: this 1-worker run cannot split
    # their error feedback.
    step_dir = tmp_path / "worker-state" / "step-000000003"
    os.rename(step_dir / "worker-0-of-1", step_dir / "worker-0-of-2")
    strategy = tfscale.Strategy(options)
    model = _compiled_model(strategy, seed=1)
    with strategy.scope():
        assert checkpoint.restore(model, tmp_path) == 3
        state = strategy.worker_state(model)
    assert np.all(state.error[0].numpy() == 0) and np.all(state.q[0].numpy() == 3.0)
    assert ("holds PowerSGD error feedback of 2 workers; this run has 1. Each "
            "worker's error feedback belongs to its own gradients") in caplog.text


def test_buckets_follow_backprop_and_each_starts_with_its_own_gradients():
    """Matrices are bucketed last layer first; a bucket's P all-reduce waits
    only for its own gradients (traced graph), and splitting into buckets
    changes no result (identity sums, one process: bitwise)."""
    shapes = [(3, 3, 16, 32), (32,), (3, 3, 32, 64), (64, 10)]
    matrices = powersgd.plan(shapes, ["float32"] * 4, rank=4)
    assert [m.index for m in matrices] == [0, 2, 3]
    # Backward: tensor 3 (2,560 bytes) + tensor 2 (73,728) close a bucket
    # of >= 40,000; tensor 0 goes alone.
    assert powersgd.backward_buckets(matrices, 40_000) == [[1, 2], [0]]
    assert powersgd.backward_buckets(matrices, None) == [[0, 1, 2]]
    assert powersgd.backward_buckets(matrices, 0) == [[2], [1], [0]]

    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    grads = [tf.random.stateless_normal(s, seed=[7, i]) for i, s in enumerate(shapes)]

    def run(bucket_bytes, sums=None):
        def sum_fn(tensors):
            if sums is not None:
                sums.append(list(tensors))
            return list(tensors)
        compressor = powersgd.PowerSGD(sum_fn, num_workers=1, start_step=0,
                                       bucket_bytes=bucket_bytes)
        optimizer = object()
        compressor.state(optimizer, variables)
        return compressor, optimizer

    outputs = {}
    for bucket_bytes in (None, 40_000):
        compressor, optimizer = run(bucket_bytes)
        outputs[bucket_bytes] = [o.numpy() for o in compressor.all_reduce(
            grads, optimizer, variables, step=0)]
    for one, bucketed in zip(outputs[None], outputs[40_000]):
        np.testing.assert_array_equal(one, bucketed)

    from tests.test_collective_order import waits_for
    sums = []
    compressor, optimizer = run(40_000, sums)
    graph = tf.function(lambda *g: compressor.all_reduce(  # as Keras traces: no autograph
        list(g), optimizer, variables, step=0), autograph=False).get_concrete_function(
            *[tf.TensorSpec(s, tf.float32) for s in shapes]).graph
    placeholders = [op for op in graph.get_operations() if op.type == "Placeholder"]
    # Calls: the uncompressed rest, then P and Q of each bucket.
    assert len(sums) == 1 + 2 * 2
    first_p = sums[1][0].op
    assert waits_for(first_p, placeholders[3]) and waits_for(first_p, placeholders[2])
    assert not waits_for(first_p, placeholders[0])
    assert waits_for(sums[3][0].op, placeholders[0])
