"""Tests for tfscale.optimizers.RMSpropWarmup: the update rule against a
float64 NumPy reference across the whole switch, serialization, argument
errors, and training under tfscale.Strategy."""

import json
import math

import keras
import numpy as np
import pytest
from keras import ops

import tfscale
from keras_backend import float64
from keras_backend import tensorflow_only
from tfscale import schedules
from tfscale.optimizers import RMSpropWarmup
from tfscale.optimizers.rmsprop_warmup import sgd_coefficient


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _reference(w, grads, *, lr, lr_rms, mu1, mu2, eps, center, period, wd=0.0):
    """The rule of the class docstring in float64; returns w after each step."""
    w = np.asarray(w, np.float64)
    m = np.zeros_like(w)
    d = np.zeros_like(w)
    out = []
    for t, g in enumerate(grads):
        g = np.asarray(g, np.float64) + wd * w
        x = (t - center) / period
        alpha_sgd = 0.5 * math.exp(2 * x) if x < 0 else min(0.5 + x, 1.0)
        alpha_rms = (1 - alpha_sgd) * lr_rms / lr
        m = mu2 * m + (1 - mu2) * g * g
        d = mu1 * d - (alpha_sgd + alpha_rms / (np.sqrt(m) + eps)) * g
        w = w + lr * d
        out.append(w.copy())
    return out


# Learning rates exact in float32 (Keras keeps the learning rate in a float32
# variable), so the float64 run can be pinned to 1e-12.
HYPER = dict(lr=0.25, lr_rms=2.0**-7, mu1=0.9, mu2=0.99, eps=1e-8, center=4.0,
             period=4.0)


def _optimizer(**overrides):
    h = {**HYPER, **overrides}
    return RMSpropWarmup(
        learning_rate=h["lr"], rmsprop_learning_rate=h["lr_rms"], mu1=h["mu1"],
        mu2=h["mu2"], epsilon=h["eps"], beta_center=h["center"],
        beta_period=h["period"], weight_decay_rate=h.get("wd", 0.0))


def test_sgd_coefficient_at_both_ends_and_in_the_middle():
    # center 4, period 4: 0.5 exp(2 x) before, 0.5 + x up to x = 0.5, then 1.
    values = [sgd_coefficient(t, 4.0, 4.0) for t in (0, 2, 4, 5, 6, 7, 100)]
    np.testing.assert_allclose(
        values, [0.5 * math.exp(-2), 0.5 * math.exp(-1), 0.5, 0.75, 1.0, 1.0,
                 1.0], rtol=1e-15)
    # Continuous in value and slope at the center (1 / period on both sides).
    h = 1e-6
    left = (sgd_coefficient(4.0, 4.0, 4.0) - sgd_coefficient(4.0 - h, 4.0, 4.0)) / h
    right = (sgd_coefficient(4.0 + h, 4.0, 4.0) - sgd_coefficient(4.0, 4.0, 4.0)) / h
    assert left == pytest.approx(0.25, rel=1e-5)
    assert right == pytest.approx(0.25, rel=1e-5)


@pytest.mark.parametrize("dtype, rtol", [pytest.param("float64", 1e-12, marks=float64),
                                         ("float32", 2e-6)])
def test_update_matches_numpy_reference_through_the_switch(dtype, rtol):
    """12 steps: RMSprop-dominated (alpha_sgd = 0.068 at step 0), the center
    (step 4), the linear part (5), and pure momentum SGD (6 on)."""
    rng = np.random.default_rng(0)
    init = rng.standard_normal((5, 3))
    # Gradients of very different scales per row: RMSprop and SGD steps differ.
    scales = np.array([1e-3, 1e-1, 1.0, 10.0, 100.0])[:, None]
    grads = [rng.standard_normal((5, 3)) * scales for _ in range(12)]
    variable = keras.Variable(init.astype(dtype), dtype=dtype, name="kernel")
    optimizer = _optimizer()
    expected = _reference(init, grads, **HYPER)
    for step, g in enumerate(grads):
        optimizer.apply([ops.convert_to_tensor(g.astype(dtype))], [variable])
        np.testing.assert_allclose(variable.numpy(), expected[step], rtol=rtol,
                                   atol=rtol, err_msg=f"step {step}")
    assert int(optimizer.iterations.numpy()) == 12


def test_first_step_is_rmsprop_and_late_steps_are_momentum_sgd():
    """The two ends, against the optimizers they become: step 0 with the
    center far away is RMSprop's step (lr_rms * g / (sqrt(m) + eps), m =
    (1 - mu2) g^2); long after the switch the update is Keras's SGD."""
    rng = np.random.default_rng(1)
    init = rng.standard_normal((4, 4)).astype(np.float64)
    g = rng.standard_normal((4, 4))
    variable = keras.Variable(init, dtype="float64", name="w")
    _optimizer(center=1000.0).apply([ops.convert_to_tensor(g)], [variable])
    rmsprop_step = 2.0**-7 * g / (np.sqrt((1 - 0.99) * g * g) + 1e-8)
    np.testing.assert_allclose(init - variable.numpy(), rmsprop_step, rtol=1e-5)

    # From step 10, past center + period / 2 = 3: momentum SGD exactly.
    grads = [rng.standard_normal((4, 4)) for _ in range(5)]
    ours = keras.Variable(init, dtype="float64", name="w")
    sgd = keras.Variable(init, dtype="float64", name="w")
    warmup = _optimizer(center=2.0, period=2.0)
    warmup.build([ours])
    warmup.iterations.assign(10)
    reference = keras.optimizers.SGD(learning_rate=0.25, momentum=0.9)
    for g in grads:
        warmup.apply([ops.convert_to_tensor(g)], [ours])
        reference.apply([ops.convert_to_tensor(g)], [sgd])
    # (Keras's SGD rounds its momentum 0.9 through float32: 3e-7 apart.)
    np.testing.assert_allclose(ours.numpy(), sgd.numpy(), rtol=2e-6)


@float64
def test_weight_decay_skips_biases_and_batch_norm():
    rng = np.random.default_rng(2)
    with keras.name_scope("dense"):
        kernel = keras.Variable(rng.standard_normal((3, 2)), dtype="float64",
                                name="kernel")
        bias = keras.Variable(rng.standard_normal((2,)), dtype="float64",
                              name="bias")
    init = [kernel.numpy(), bias.numpy()]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal((2,))]
             for _ in range(6)]
    optimizer = _optimizer(wd=0.05)
    for g in grads:
        optimizer.apply([ops.convert_to_tensor(x) for x in g], [kernel, bias])
    expected_kernel = _reference(init[0], [g[0] for g in grads], **HYPER, wd=0.05)
    expected_bias = _reference(init[1], [g[1] for g in grads], **HYPER, wd=0.0)
    np.testing.assert_allclose(kernel.numpy(), expected_kernel[-1], rtol=1e-12)
    np.testing.assert_allclose(bias.numpy(), expected_bias[-1], rtol=1e-12)


def test_zero_learning_rate_leaves_weights_unchanged():
    variable = keras.Variable(np.ones((2, 2)), dtype="float64", name="w")
    optimizer = RMSpropWarmup(learning_rate=schedules.Warmup(1.0, 10))
    optimizer.apply([ops.convert_to_tensor(np.full((2, 2), 3.0))], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.ones((2, 2)))


CONFIG = dict(rmsprop_learning_rate=1e-3, mu1=0.8, mu2=0.95, epsilon=1e-7,
              beta_center=390.0, beta_period=195.0, weight_decay_rate=1e-4,
              exclude_from_weight_decay=["bias"], name="warm")


def test_config_round_trip_and_keras_serialization():
    lr = schedules.SlowStart(12.8, 3510)
    optimizer = RMSpropWarmup(learning_rate=lr, **CONFIG)
    config = optimizer.get_config()
    for key, value in CONFIG.items():
        assert config[key] == value, key
    json.dumps(config)
    assert RMSpropWarmup.from_config(optimizer.get_config()).get_config() == config
    restored = keras.optimizers.deserialize(
        json.loads(json.dumps(keras.optimizers.serialize(optimizer))))
    assert isinstance(restored, RMSpropWarmup)
    assert restored.get_config() == config


@pytest.mark.parametrize("kwargs, message", [
    (dict(rmsprop_learning_rate=-1.0), "`rmsprop_learning_rate` must be a number >= 0"),
    (dict(mu1=1.5), r"`mu1` must be a number in the range \[0, 1\]"),
    (dict(mu2=1.0), r"`mu2` must be a number in the range \[0, 1\)"),
    (dict(epsilon=0.0), "`epsilon` must be a number > 0"),
    (dict(beta_center=-1), "`beta_center` must be a number >= 0"),
    (dict(beta_period=0), "`beta_period` must be a number > 0"),
    (dict(weight_decay_rate=True), "`weight_decay_rate` must be a number >= 0"),
    (dict(exclude_from_weight_decay="bias"), "`exclude_from_weight_decay` must be None"),
])
def test_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RMSpropWarmup(**kwargs)


def _model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                             keras.layers.Dense(2)])


@tensorflow_only
def test_fit_under_tfscale_strategy_matches_fit_without():
    """One worker under tfscale.Strategy (updates routed through tfscale's
    all-reduce) trains to the same weights as plain Keras, over the switch."""
    import tensorflow as tf

    rng = np.random.default_rng(3)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = rng.normal(size=(48, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    reference = _model()
    initial = reference.get_weights()
    reference.compile(optimizer=RMSpropWarmup(0.05, beta_center=2.0,
                                              beta_period=2.0), loss="mse")
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    strategy = tfscale.Strategy()
    with strategy.scope():
        model = _model()
        model.set_weights(initial)
        model.compile(optimizer=RMSpropWarmup(0.05, beta_center=2.0,
                                              beta_period=2.0), loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1,
              verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(model.get_weights()[0], initial[0])
