"""Tests for tfscale.optimizers.LossScaleOptimizer.

The multi-worker tests start 2 real workers (tests/workers/loss_scale_worker.py)
that train under mixed_float16 with an inf in worker 1's batch at step 2 only,
with tfscale's LossScaleOptimizer given to compile, or with a plain SGD that
compile wraps itself, as Keras's mixed-precision guide teaches
(https://keras.io/guides/mixed_precision/).

Measured on the project machine (2 cores), stock Keras in that setting:
worker 0 enters the gradient all-reduce, worker 1 skips the step; neither
collective ever completes. With a 15 s collective timeout both workers fail
with `DeadlineExceededError` ("Collective has timed out during execution")
about 27 s after start; with the default timeout (none) they hang forever.
"""

import numpy as np
import pytest

import keras
from keras import ops

import tfscale
from keras_backend import tensorflow_only
from tests import multiworker

BAD_STEP = 2
STEPS = 6
TFSCALE_CLASS = "tfscale.optimizers.loss_scale.LossScaleOptimizer"
KERAS_CLASS = "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _tiny_model():
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(2),
        keras.layers.Activation("linear", dtype="float32"),
    ])


def test_is_a_keras_loss_scale_optimizer_and_compile_does_not_rewrap():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _tiny_model()
    optimizer = tfscale.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=256.0)
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer.__class__ is keras.optimizers.SGD


def test_serialization_round_trip():
    optimizer = tfscale.optimizers.LossScaleOptimizer(
        tfscale.optimizers.LARS(learning_rate=0.5, weight_decay_rate=1e-4),
        initial_scale=128.0, dynamic_growth_steps=10)
    config = keras.optimizers.serialize(optimizer)
    restored = keras.optimizers.deserialize(config)
    assert type(restored) is tfscale.optimizers.LossScaleOptimizer
    assert type(restored.inner_optimizer) is tfscale.optimizers.LARS
    assert restored.get_config() == optimizer.get_config()
    assert restored.initial_scale == 128.0
    assert restored.dynamic_growth_steps == 10


def test_check_finite_without_a_strategy_is_local():
    optimizer = tfscale.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    finite = [ops.ones([2]), None, ops.zeros([3, 1])]
    assert bool(optimizer.check_finite(finite))
    assert not bool(optimizer.check_finite(finite + [ops.convert_to_tensor([np.inf])]))
    assert not bool(optimizer.check_finite([ops.convert_to_tensor([0.0, np.nan])]))


def test_one_process_skips_a_non_finite_step_and_halves_the_scale():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = _tiny_model()
    optimizer = tfscale.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=256.0)
    model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((2, 4, 3), np.float32)
    x[1, 0, 0] = np.inf
    y = np.zeros((4, 2), np.float32)
    model.train_on_batch(x[0], y)
    before = [v.numpy() for v in model.trainable_variables]
    model.train_on_batch(x[1], y)
    after = [v.numpy() for v in model.trainable_variables]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert float(optimizer.dynamic_scale.numpy()) == 128.0


@tensorflow_only
def test_compile_wraps_in_tfscale_loss_scale_under_a_tfscale_strategy():
    """The compile hook (keras_hooks.route_compile_loss_scaling) is called:
    this fails as soon as a Keras change bypasses it."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = tfscale.Strategy()
    with strategy.scope():
        model = _tiny_model()
        sgd = keras.optimizers.SGD(0.1)
        model.compile(optimizer=sgd, loss="mse")
    assert type(model.optimizer) is tfscale.optimizers.LossScaleOptimizer
    assert model.optimizer.inner_optimizer is sgd
    assert model.optimizer.name == "loss_scale_optimizer"
    assert model.optimizer.initial_scale == 2.0**15  # Keras's default
    # A LossScaleOptimizer given to compile is used as it is, Keras's too.
    with strategy.scope():
        model = _tiny_model()
        given = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
        model.compile(optimizer=given, loss="mse")
    assert model.optimizer is given
    # Outside a tfscale.Strategy compile keeps Keras's own class.
    model = _tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    # Other policies are not wrapped at all.
    keras.mixed_precision.set_global_policy("float32")
    with strategy.scope():
        model = _tiny_model()
        model.compile(optimizer=sgd, loss="mse")
    assert model.optimizer is sgd


def _assert_agreed_skip(run, initial_scale):
    """Both workers skipped BAD_STEP together, halved the scale together and
    hold bitwise identical weights at every step."""
    multiworker.assert_succeeded(run)
    chief, other = run.results
    for result in run.results:
        assert result["done"]
        assert result["optimizer_class"] == TFSCALE_CLASS
        # Entry 0: before training; entry k + 1: after step k.
        assert len(result["weights"]) == STEPS + 1
        # Both workers skipped step BAD_STEP: weights unchanged by it...
        assert result["weights"][BAD_STEP + 1] == result["weights"][BAD_STEP]
        # ...but changed by the steps before and after it.
        assert result["weights"][BAD_STEP] != result["weights"][BAD_STEP - 1]
        assert result["weights"][BAD_STEP + 2] != result["weights"][BAD_STEP + 1]
        assert np.isfinite(np.concatenate(result["weights"][-1])).all()
        # ...the scale was halved once, together, and the step not counted.
        assert result["scales"] == (
            [initial_scale] * (BAD_STEP + 1)
            + [initial_scale / 2] * (STEPS - BAD_STEP))
        assert result["iterations"] == (
            list(range(BAD_STEP + 1)) + list(range(BAD_STEP, STEPS)))
    # Bitwise identical on both workers, at every step (JSON floats of
    # float32 values round-trip exactly).
    assert chief["weights"] == other["weights"]
    assert chief["scales"] == other["scales"]


@pytest.mark.multiworker
def test_workers_agree_to_skip_when_one_overflows(tmp_path):
    run = multiworker.run_workers(
        "loss_scale_worker.py", 2, tmp_path,
        args=[f"--steps={STEPS}", f"--bad_step={BAD_STEP}"], timeout=120)
    _assert_agreed_skip(run, initial_scale=1024.0)


@pytest.mark.multiworker
def test_keras_guide_mixed_float16_fit_agrees_to_skip(tmp_path):
    """A user who follows Keras's guide (set the mixed_float16 policy, compile
    a plain SGD) gets tfscale's agreed skip under tfscale.Strategy."""
    run = multiworker.run_workers(
        "loss_scale_worker.py", 2, tmp_path,
        args=["--loss_scale=compile", f"--steps={STEPS}",
              f"--bad_step={BAD_STEP}"], timeout=120)
    _assert_agreed_skip(run, initial_scale=2.0**15)


@pytest.mark.multiworker
def test_keras_loss_scale_deadlocks_when_one_worker_overflows(tmp_path):
    """The failure tfscale's LossScaleOptimizer fixes: Keras's own, which
    compile picks for the Keras-guide program under stock MWMS."""
    run = multiworker.launch_workers("loss_scale_worker.py", 2, tmp_path,
        why='the stock loss scale deadlocks on purpose: its workers must fail',
        args=["--strategy=stock", "--loss_scale=compile",
              f"--steps={STEPS}", f"--bad_step={BAD_STEP}",
              "--collective_timeout=15"],
        timeout=90)
    assert run.returncode not in (0, 124), run.output[-3000:]
    assert "Collective has timed out" in run.output, run.output[-3000:]
    # Both got through the steps before the bad one and no further.
    for result in run.results:
        assert result is not None and not result["done"]
        assert result["optimizer_class"] == KERAS_CLASS
        assert len(result["weights"]) == BAD_STEP + 1


@pytest.mark.multiworker
def test_keras_loss_scale_optimizer_given_to_compile_is_kept_under_tfscale(tmp_path):
    """Keras's own LossScaleOptimizer given to compile explicitly is used as
    given (with the per-worker skip that deadlocks above); nothing overflows
    here, so both workers finish."""
    run = multiworker.run_workers(
        "loss_scale_worker.py", 2, tmp_path,
        args=["--loss_scale=stock", f"--steps={STEPS}", "--bad_step=-1"],
        timeout=120)
    multiworker.assert_succeeded(run)
    for result in run.results:
        assert result["done"] and result["optimizer_class"] == KERAS_CLASS
        assert len(result["weights"]) == STEPS + 1
    assert run.results[0]["weights"] == run.results[1]["weights"]
