"""Tests for HALP, SVRG and low-precision SGD (tfscale.optimizers): parity
with a float64 NumPy reference fed the same rounding noise, the offset on
its grid, HALP's linear convergence where low-precision SGD stalls, argument
errors, serialization, and two workers keeping identical weights."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import multiworker
from tfscale import models
from tfscale import optimizers
from tfscale.optimizers import quantize

FEATURES = 4
EXAMPLES = 64
BATCH = 8
L2 = 0.0625  # exact in float32, as Keras casts it; L2(l2) adds l2 * ||w||^2: mu >= 2 * L2


@pytest.fixture(autouse=True)
def _float64():
    """float64 layers and compiled loss (floatx), whatever dtype policy an
    earlier test left set (a policy set explicitly overrides floatx)."""
    policy = keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_dtype_policy(policy)
    keras.config.set_floatx("float32")


def LOSS():
    return keras.losses.BinaryCrossentropy(from_logits=True, dtype="float64")


def logistic_data(examples=EXAMPLES, features=FEATURES, seed=0):
    """Synthetic binary labels drawn from a logistic model (float64)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, features))
    truth = rng.normal(size=features)
    y = (rng.random(examples) < 1 / (1 + np.exp(-x @ truth))).astype(np.float64)
    return x, y[:, None]


def logistic_model(use_bias):
    """L2-regularized logistic regression in float64: one Dense unit."""
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((FEATURES,), dtype="float64"),
        keras.layers.Dense(1, use_bias=use_bias, dtype="float64",
                           kernel_initializer="zeros",
                           kernel_regularizer=keras.regularizers.L2(L2)),
    ])


def batches(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


# --------------------------------------------------------------------------
# float64 NumPy reference of the same algorithms
# --------------------------------------------------------------------------


def reference_gradient(kernel, bias, x, y):
    """Gradient of mean log-loss + L2 * ||kernel||^2 over the batch (x, y)."""
    logits = x @ kernel + bias
    error = 1 / (1 + np.exp(-logits)) - y
    return (x.T @ error / len(x) + 2 * L2 * kernel,
            error.sum(axis=0) / len(x))


def noise(seed, step, index, shape):
    return quantize.rounding_noise(seed, step, index, shape, tf.float64).numpy()


def reference_round(value, scale, bits, draws):
    if scale == 0:
        return np.zeros_like(value)
    low, high = -(2.0 ** (bits - 1)), 2.0 ** (bits - 1) - 1
    return np.clip(np.floor(value / scale + draws), low, high) * scale


def reference_halp(x, y, steps, lr, epoch_length, bits, mu, seed, use_bias):
    """De Sa et al.'s HALP (bits=None: SVRG); the weights after every step."""
    w = [np.zeros((FEATURES, 1)), np.zeros(1)]
    n = len(x) // BATCH
    trajectory = []
    for step in range(steps):
        if step % epoch_length == 0:
            anchor = [v.copy() for v in w]
            full = reference_gradient(*anchor, x, y)
            full = full if use_bias else (full[0], np.zeros(1))
            offset = [np.zeros_like(v) for v in w]
            norm = np.sqrt(sum(np.sum(g ** 2) for g in full[:1 + use_bias]))
            scale = norm / (mu * (2.0 ** (bits - 1) - 1)) if bits else None
        i = slice((step % n) * BATCH, (step % n + 1) * BATCH)
        here = reference_gradient(*[a + z for a, z in zip(anchor, offset)], x[i], y[i])
        there = reference_gradient(*anchor, x[i], y[i])
        for index in range(1 + use_bias):
            moved = offset[index] - lr * (here[index] - there[index] + full[index])
            if bits:
                moved = reference_round(moved, scale, bits,
                                        noise(seed, step, index, moved.shape))
            offset[index] = moved
            w[index] = anchor[index] + moved
        trajectory.append([v.copy() for v in w[:1 + use_bias]])
    return trajectory


def reference_low_precision_sgd(x, y, steps, lr, bits, scale, seed):
    w = [np.zeros((FEATURES, 1)), np.zeros(1)]
    n = len(x) // BATCH
    trajectory = []
    for step in range(steps):
        i = slice((step % n) * BATCH, (step % n + 1) * BATCH)
        gradient = reference_gradient(*w, x[i], y[i])
        for index in range(2):
            moved = w[index] - lr * gradient[index]
            w[index] = reference_round(moved, scale, bits,
                                       noise(seed, step, index, moved.shape))
        trajectory.append([v.copy() for v in w])
    return trajectory


def float64_optimum(x, y):
    """Newton's method to machine precision (no bias)."""
    w = np.zeros((FEATURES, 1))
    for _ in range(50):
        p = 1 / (1 + np.exp(-x @ w))
        hessian = x.T @ (x * (p * (1 - p))) / len(x) + 2 * L2 * np.eye(FEATURES)
        w -= np.linalg.solve(hessian, reference_gradient(w, 0.0, x, y)[0])
    return w


# --------------------------------------------------------------------------
# Training through model.fit, recording every step
# --------------------------------------------------------------------------


class Recorder(keras.callbacks.Callback):
    """Weights (and HALP's offsets and scale) after every step."""

    def __init__(self, variables, halp=None):
        super().__init__()
        self.variables, self.halp = variables, halp
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        record = {"weights": [v.numpy().copy() for v in self.variables]}
        if self.halp is not None and self.halp.bits is not None:
            record["offsets"] = [z.numpy().copy() for z in self.halp.offsets]
            record["scale"] = float(self.halp.scale.numpy())
        self.steps.append(record)


def fit_variance_reduced(optimizer, steps, use_bias, x, y):
    model = logistic_model(use_bias)
    trainer = models.VarianceReducedModel(model, full_gradient_data=batches(x, y))
    trainer.compile(optimizer=optimizer,
                    loss=LOSS())
    recorder = Recorder(model.trainable_variables, optimizer)
    trainer.fit(batches(x, y).repeat(), steps_per_epoch=steps, epochs=1,
                callbacks=[recorder], verbose=0, shuffle=False)
    return recorder.steps


def fit_low_precision_sgd(optimizer, steps, x, y):
    model = logistic_model(use_bias=True)
    model.compile(optimizer=optimizer,
                  loss=LOSS())
    recorder = Recorder(model.trainable_variables)
    model.fit(batches(x, y).repeat(), steps_per_epoch=steps, epochs=1,
              callbacks=[recorder], verbose=0, shuffle=False)
    return recorder.steps


# --------------------------------------------------------------------------
# The quantizer
# --------------------------------------------------------------------------


def test_stochastic_round_is_unbiased_on_the_grid_and_clamped():
    x = tf.constant([0.3, -0.3, 1.37, 100.0, -100.0], tf.float64)
    scale = tf.constant(0.25, tf.float64)
    draws = tf.random.stateless_uniform((20000, 5), seed=[1, 2], dtype=tf.float64)
    rounded = quantize.stochastic_round(x[None, :], scale, 4, draws).numpy()
    steps = rounded / 0.25
    np.testing.assert_array_equal(steps, np.round(steps))
    assert steps.min() == -8 and steps.max() == 7
    # In range, the mean is x (unbiased); beyond it, the ends.
    np.testing.assert_allclose(rounded[:, :3].mean(axis=0), [0.3, -0.3, 1.37], atol=0.01)
    np.testing.assert_array_equal(rounded[:, 3:], [[1.75, -2.0]] * 20000)
    zero = quantize.stochastic_round(x, tf.constant(0.0, tf.float64), 4, draws[0])
    np.testing.assert_array_equal(zero.numpy(), np.zeros(5))


def test_rounding_noise_is_a_function_of_seed_step_and_variable():
    a = quantize.rounding_noise(5, 7, 1, (3,), tf.float64).numpy()
    np.testing.assert_array_equal(a, quantize.rounding_noise(5, 7, 1, (3,), tf.float64).numpy())
    for other in [(6, 7, 1), (5, 8, 1), (5, 7, 2)]:
        assert not np.array_equal(a, quantize.rounding_noise(*other, (3,), tf.float64).numpy())
    assert (a >= 0).all() and (a < 1).all()


# --------------------------------------------------------------------------
# Step-by-step parity with the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name,bits", [("HALP", 8), ("HALP", 3), ("SVRG", None)])
def test_matches_numpy_reference_step_by_step(name, bits):
    x, y = logistic_data()
    steps, epoch_length, lr, mu, seed = 40, 16, 0.5, 0.1, 11
    if name == "SVRG":
        optimizer = optimizers.SVRG(learning_rate=lr, epoch_length=epoch_length)
    else:
        optimizer = optimizers.HALP(learning_rate=lr, epoch_length=epoch_length,
                                    bits=bits, mu=mu, seed=seed)
    got = fit_variance_reduced(optimizer, steps, use_bias=True, x=x, y=y)
    want = reference_halp(x, y, steps, lr, epoch_length, bits, mu, seed, use_bias=True)
    assert len(got) == steps
    for step, (record, expected) in enumerate(zip(got, want)):
        for value, reference in zip(record["weights"], expected):
            np.testing.assert_allclose(value, reference, rtol=1e-9, atol=1e-12,
                                       err_msg=f"step {step}")


def test_low_precision_sgd_matches_numpy_reference_step_by_step():
    x, y = logistic_data()
    steps, lr, bits, scale, seed = 24, 0.5, 8, 2.0 ** -7, 4
    optimizer = optimizers.LowPrecisionSGD(learning_rate=lr, bits=bits, scale=scale,
                                           seed=seed)
    got = fit_low_precision_sgd(optimizer, steps, x, y)
    want = reference_low_precision_sgd(x, y, steps, lr, bits, scale, seed)
    for step, (record, expected) in enumerate(zip(got, want)):
        for value, reference in zip(record["weights"], expected):
            np.testing.assert_allclose(value, reference, rtol=1e-9, atol=1e-12,
                                       err_msg=f"step {step}")
            np.testing.assert_allclose(value / scale, np.round(value / scale), atol=1e-9)


def test_offset_stays_on_its_grid_and_inside_its_bounds():
    x, y = logistic_data()
    # 8 levels, and a mu above the problem's (0.125): a grid too small to
    # cover the optimum, so z reaches its bounds and is clamped there.
    bits = 3
    optimizer = optimizers.HALP(learning_rate=0.5, epoch_length=16, bits=bits, mu=2.0)
    records = fit_variance_reduced(optimizer, 48, use_bias=True, x=x, y=y)
    low, high = quantize.grid_bounds(bits)
    levels = []
    for step, record in enumerate(records):
        assert record["scale"] > 0
        for offset in record["offsets"]:
            level = offset / record["scale"]
            np.testing.assert_allclose(level, np.round(level), atol=1e-9,
                                       err_msg=f"step {step}: z off its grid")
            assert low <= level.min() and level.max() <= high, f"step {step}"
            levels.extend(np.round(level).ravel())
    assert low in levels or high in levels, "the bounds were never reached"
    # The scale shrinks with the full gradient, epoch after epoch.
    scales = [records[k]["scale"] for k in (0, 16, 32)]
    assert scales[0] > scales[1] > scales[2]


# --------------------------------------------------------------------------
# Convergence on the strongly convex problem
# --------------------------------------------------------------------------


def test_8_bit_halp_converges_linearly_where_8_bit_low_precision_sgd_stalls():
    x, y = logistic_data()
    optimum = float64_optimum(x, y)
    epochs, epoch_length, lr = 10, 16, 0.5

    def relative_error(kernel):
        return np.linalg.norm(kernel - optimum) / np.linalg.norm(optimum)

    halp = fit_variance_reduced(
        optimizers.HALP(learning_rate=lr, epoch_length=epoch_length, bits=8,
                        mu=2 * L2, seed=1),
        epochs * epoch_length, use_bias=False, x=x, y=y)
    halp_errors = [relative_error(halp[(k + 1) * epoch_length - 1]["weights"][0])
                   for k in range(epochs)]
    # The SGD grid covers the optimum with room to spare, as HALP's does.
    scale = 1.25 * np.abs(optimum).max() / 127
    sgd = []
    for learning_rate in (0.5, 0.1):
        records = fit_low_precision_sgd(
            optimizers.LowPrecisionSGD(learning_rate=learning_rate, bits=8,
                                       scale=scale, seed=1),
            epochs * epoch_length, x, y)
        sgd.append([relative_error(r["weights"][0]) for r in records])
    print("HALP relative error per epoch:", ["%.1e" % e for e in halp_errors])
    print("LP-SGD best relative error over the last epoch:",
          ["%.1e" % min(e[-epoch_length:]) for e in sgd])
    assert halp_errors[-1] < 1e-6
    # Linear: every epoch divides the error by at least 4.
    assert all(b < a / 4 for a, b in zip(halp_errors, halp_errors[1:]))
    for errors in sgd:
        assert min(errors[-epoch_length:]) > 1e-3  # its floor, 1000x HALP's end


# --------------------------------------------------------------------------
# Arguments, serialization, misuse
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arguments,message", [
    ({"bits": 1}, r"`bits` must be an integer >= 2, or None.*bits=1"),
    ({"bits": 8.0}, r"`bits` must be an integer.*bits=8.0"),
    ({"epoch_length": 0}, r"`epoch_length` must be an integer >= 1.*epoch_length=0"),
    ({"mu": 0}, r"`mu` must be a number > 0.*mu=0"),
    ({"clipnorm": 1.0}, r"HALP does not take \['clipnorm'\].*clipnorm=1.0"),
])
def test_halp_argument_errors(arguments, message):
    with pytest.raises(ValueError, match=message):
        optimizers.HALP(**arguments)


def test_low_precision_sgd_argument_errors():
    with pytest.raises(ValueError, match=r"`scale` must be a number > 0.*scale=0"):
        optimizers.LowPrecisionSGD(scale=0)
    with pytest.raises(ValueError, match=r"`bits` must be an integer >= 2\. .*bits=None"):
        optimizers.LowPrecisionSGD(bits=None)


@pytest.mark.parametrize("optimizer", [
    optimizers.HALP(learning_rate=0.3, epoch_length=12, bits=6, mu=0.2, seed=3),
    optimizers.SVRG(learning_rate=0.3, epoch_length=12),
    optimizers.LowPrecisionSGD(learning_rate=0.3, bits=6, scale=0.01, seed=3),
])
def test_serialization_round_trip(optimizer):
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(restored) is type(optimizer)
    assert restored.get_config() == optimizer.get_config()


def test_halp_without_the_variance_reduced_model_is_refused():
    x, y = logistic_data()
    model = logistic_model(use_bias=True)
    model.compile(optimizer=optimizers.HALP(), loss=LOSS())
    with pytest.raises(ValueError, match=r"VarianceReducedModel\(model\)"):
        model.fit(x, y, epochs=1, verbose=0)


def test_variance_reduced_model_argument_errors():
    x, y = logistic_data()
    model = logistic_model(use_bias=True)
    with pytest.raises(TypeError, match="must be a `tf.data.Dataset`"):
        models.VarianceReducedModel(model, full_gradient_data=(x, y))
    with pytest.raises(ValueError, match=r"must be finite.*Drop its `.repeat\(\)`"):
        models.VarianceReducedModel(model, batches(x, y).repeat())
    trainer = models.VarianceReducedModel(model, batches(x, y))
    with pytest.raises(TypeError, match=r"trains with `tfscale.optimizers.HALP`.*SGD"):
        trainer.compile(optimizer=keras.optimizers.SGD(), loss=LOSS())
    trainer.compile(optimizer=optimizers.HALP(epoch_length=5), steps_per_execution=2,
                    loss=LOSS())
    with pytest.raises(ValueError, match=r"`steps_per_execution` must divide.*\(5\)"):
        trainer.fit(batches(x, y), epochs=1, verbose=0)


# --------------------------------------------------------------------------
# Two workers
# --------------------------------------------------------------------------


@pytest.mark.multiworker
def test_two_workers_keep_identical_weights_and_sum_every_shard_into_the_full_gradient(
        tmp_path):
    run = multiworker.run_workers("halp_worker.py", 2, tmp_path, timeout=180)
    multiworker.assert_succeeded(run)
    first, second = run.results
    # Bitwise: JSON carries float64 exactly.
    assert first["weights"] == second["weights"]
    assert first["full_gradient"] == second["full_gradient"]
    assert first["iterations"] == second["iterations"] == first["steps"]
    assert first["weights"] != first["initial_weights"]
    # The full gradient at the anchor is the mean over all examples, not
    # over one worker's half.
    x, y = (np.array(first["x"]), np.array(first["y"]))
    kernel, bias = (np.array(v) for v in first["anchor"])
    want = reference_gradient(kernel.reshape(-1, 1), bias, x, y)
    for got, expected in zip(first["full_gradient"], want):
        np.testing.assert_allclose(np.array(got).reshape(expected.shape), expected,
                                   rtol=1e-10, atol=1e-14)
