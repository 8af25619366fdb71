"""Tests for tfscale.optimizers.LARS: parity with a float64 NumPy reference,
serialization, argument errors, mixed precision and the FP16 failure mode."""

import json
import re

import keras
import numpy as np
import pytest
from keras import ops

from keras_backend import BACKEND
from keras_backend import tensorflow_only
from tfscale import schedules
from tfscale.optimizers import LARS


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


# --------------------------------------------------------------------------
# float64 NumPy reference
# --------------------------------------------------------------------------


def _reference_step(w, g, v, *, lr, momentum, weight_decay_rate, eeta,
                    epsilon, nesterov, decay, adapt):
    """One LARS step in float64; returns (new_w, new_v)."""
    w = np.asarray(w, np.float64)
    g = np.asarray(g, np.float64)
    if decay:
        g = g + weight_decay_rate * w
    trust = 1.0
    w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
    if adapt and w_norm > 0 and g_norm > 0:
        trust = eeta * w_norm / (g_norm + epsilon)
    v = momentum * v + lr * trust * g
    if nesterov:
        w = w - (momentum * v + lr * trust * g)
    else:
        w = w - v
    return w, v


# name -> (shape, use weight decay by default, use adaptation by default)
_VARIABLES = {
    "dense/kernel": ((4, 3), True, True),
    "dense/bias": ((3,), False, False),
    "batch_normalization/gamma": ((3,), False, False),
    "batch_normalization/beta": ((3,), False, False),
    "conv2d/kernel": ((2, 2, 3, 4), True, True),
    # A rank-1 variable whose name matches no pattern: excluded by the
    # rank-0/1 fallback of the default rule only.
    "custom/scale": ((5,), False, False),
    # A matrix whose name contains "bn" only inside a word: not excluded.
    "block_bneck/kernel": ((3, 3), True, True),
    # A layer named with a "bn" token: excluded by name.
    "conv1_bn/moving_thing": ((2, 3), False, False),
}


def _make_variables(rng, zero=()):
    variables = []
    for path, (shape, _, _) in _VARIABLES.items():
        scope, name = path.split("/")
        value = rng.standard_normal(shape).astype(np.float32)
        if path in zero:
            value[...] = 0.0
        with keras.name_scope(scope):
            variables.append(keras.Variable(value, name=name))
    assert [v.path for v in variables] == list(_VARIABLES)
    return variables


def _run_parity(flags, steps=4, zero_weights=(), zero_grads=(), **kwargs):
    """Runs LARS(**kwargs) for `steps` steps and the reference alongside.

    `flags(path) -> (decay, adapt)` says what the reference should do.
    """
    rng = np.random.default_rng(0)
    variables = _make_variables(rng, zero=zero_weights)
    hyper = dict(lr=0.5, momentum=0.9, weight_decay_rate=0.0, eeta=0.1,
                 epsilon=0.0, nesterov=False)
    args = dict(learning_rate=hyper["lr"], momentum=hyper["momentum"],
                eeta=hyper["eeta"])
    args.update(kwargs)
    hyper.update({k: v for k, v in kwargs.items() if k in hyper})
    hyper["lr"] = args["learning_rate"]
    optimizer = LARS(**args)

    ref_w = [v.numpy().astype(np.float64) for v in variables]
    ref_v = [np.zeros_like(w) for w in ref_w]
    for _ in range(steps):
        grads = []
        for path, v in zip(_VARIABLES, variables):
            g = rng.standard_normal(v.shape).astype(np.float32)
            if path in zero_grads:
                g[...] = 0.0
            grads.append(g)
        optimizer.apply([ops.convert_to_tensor(g) for g in grads], variables)
        for i, path in enumerate(_VARIABLES):
            decay, adapt = flags(path)
            ref_w[i], ref_v[i] = _reference_step(
                ref_w[i], grads[i], ref_v[i], decay=decay, adapt=adapt, **hyper
            )
        for i, path in enumerate(_VARIABLES):
            np.testing.assert_allclose(
                variables[i].numpy(), ref_w[i], rtol=2e-5, atol=2e-6,
                err_msg=path,
            )
            if hyper["momentum"]:
                np.testing.assert_allclose(
                    optimizer.momentums[i].numpy(), ref_v[i], rtol=2e-5,
                    atol=2e-6, err_msg=path,
                )
    return optimizer, variables


def _default_flags(weight_decay_rate):
    def flags(path):
        _, decay, adapt = _VARIABLES[path]
        return decay and weight_decay_rate > 0, adapt

    return flags


def test_parity_plain():
    _run_parity(_default_flags(0.0))


def test_parity_weight_decay_default_exclusions():
    _run_parity(_default_flags(0.01), weight_decay_rate=0.01)


def test_parity_nesterov_epsilon():
    _run_parity(_default_flags(0.01), weight_decay_rate=0.01, nesterov=True,
                epsilon=0.5)


def test_parity_no_momentum():
    optimizer, _ = _run_parity(_default_flags(0.0), momentum=0.0)
    assert optimizer.momentums == []


def test_parity_explicit_exclusions_by_name():
    # An explicit list replaces the built-in rule: the rank-1 fallback and
    # the built-in patterns no longer apply.
    def flags(path):
        decay = not re.search("bias", path)
        adapt = not re.search("gamma|beta", path)
        return decay, adapt

    _run_parity(flags, weight_decay_rate=0.01,
                exclude_from_weight_decay=["bias"],
                exclude_from_layer_adaptation=["gamma", "beta"])


def test_parity_layer_adaptation_defaults_to_weight_decay_list():
    def flags(path):
        excluded = bool(re.search("kernel", path))
        return not excluded, not excluded

    _run_parity(flags, weight_decay_rate=0.01,
                exclude_from_weight_decay=["kernel"])


def test_parity_empty_lists_exclude_nothing():
    _run_parity(lambda path: (True, True), weight_decay_rate=0.01,
                exclude_from_weight_decay=[], exclude_from_layer_adaptation=[])


def test_zero_norm_weight_and_gradient_use_trust_one():
    # Parity over several steps with one all-zero kernel and one kernel whose
    # gradients are all zero.
    _run_parity(_default_flags(0.01), weight_decay_rate=0.01,
                zero_weights=("dense/kernel",), zero_grads=("conv2d/kernel",))

    # Explicitly: ||w|| = 0 gives trust 1 (not eeta * 0 / ||g|| = 0), so the
    # first step moves w by -lr * g; ||g|| = 0 leaves w unchanged, no NaN.
    w = keras.Variable(np.zeros((4, 3), np.float32), name="kernel")
    u = keras.Variable(np.ones((4, 3), np.float32), name="other")
    g = np.arange(12, dtype=np.float32).reshape(4, 3)
    optimizer = LARS(learning_rate=0.5, momentum=0.0, eeta=0.001)
    optimizer.apply([ops.convert_to_tensor(g), ops.zeros((4, 3))], [w, u])
    np.testing.assert_array_equal(w.numpy(), -0.5 * g)
    np.testing.assert_array_equal(u.numpy(), np.ones((4, 3), np.float32))


def _closure_apply(optimizer, var):
    # Variables must be captured, not passed, for tf.function.
    def apply(g):
        optimizer.apply([g], [var])

    return apply


@tensorflow_only
def test_update_inside_tf_function_matches_eager():
    import tensorflow as tf

    rng = np.random.default_rng(1)
    init = rng.standard_normal((6, 5)).astype(np.float32)
    grads = [rng.standard_normal((6, 5)).astype(np.float32) for _ in range(3)]
    results = []
    for use_function in (False, True):
        var = keras.Variable(init, name="kernel")
        optimizer = LARS(learning_rate=0.3, eeta=0.05, weight_decay_rate=1e-3)
        optimizer.build([var])
        apply = _closure_apply(optimizer, var)
        if use_function:
            apply = tf.function(apply)
        for g in grads:
            apply(tf.constant(g))
        results.append(var.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


# --------------------------------------------------------------------------
# Configuration and serialization
# --------------------------------------------------------------------------

_CONFIG_ARGS = dict(
    momentum=0.8,
    weight_decay_rate=5e-5,
    eeta=0.002,
    epsilon=1e-9,
    nesterov=True,
    exclude_from_weight_decay=["bias", "bn"],
    exclude_from_layer_adaptation=["bias"],
    name="my_lars",
)


def test_get_config_is_constructor_arguments():
    config = LARS(learning_rate=0.25, **_CONFIG_ARGS).get_config()
    for key, value in _CONFIG_ARGS.items():
        assert config[key] == value, key
    assert config["learning_rate"] == 0.25
    base = keras.optimizers.SGD().get_config()
    assert set(config) == (set(base) - {"momentum", "nesterov"}) | set(
        _CONFIG_ARGS
    ) | {"momentum", "nesterov"}
    defaults = LARS().get_config()
    assert defaults["exclude_from_weight_decay"] is None
    assert defaults["exclude_from_layer_adaptation"] is None
    assert defaults["name"] == "LARS"
    json.dumps(config)


def test_from_config_and_serialize_round_trip():
    lr = schedules.WarmupPolynomialDecay(10.0, decay_steps=100, warmup_steps=10)
    optimizer = LARS(learning_rate=lr, **_CONFIG_ARGS)
    config = optimizer.get_config()

    clone = LARS.from_config(optimizer.get_config())
    assert clone.get_config() == config

    serialized = keras.optimizers.serialize(optimizer)
    json.dumps(serialized)
    restored = keras.optimizers.deserialize(serialized)
    assert isinstance(restored, LARS)
    restored_lr = keras.optimizers.schedules.deserialize(
        restored.get_config()["learning_rate"])
    assert isinstance(restored_lr, schedules.WarmupPolynomialDecay)
    # The public learning rate is the schedule's value at the step (warmup).
    assert float(restored.learning_rate) == float(lr(0)) != 10.0
    assert restored.get_config() == config


def _small_model(num_classes=3):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="dense")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Dense(num_classes, name="logits")(x)
    outputs = keras.layers.Activation("softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs)


def _data(n=32, num_classes=3):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = rng.integers(0, num_classes, size=(n,))
    return x, y


def test_keras_file_round_trip(tmp_path):
    model = _small_model()
    lr = schedules.Warmup(schedules.PolynomialDecay(0.5, 100), warmup_steps=3)
    model.compile(
        optimizer=LARS(learning_rate=lr, weight_decay_rate=1e-4,
                       exclude_from_weight_decay=["bias", "bn/"]),
        loss="sparse_categorical_crossentropy",
    )
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)

    reloaded = keras.models.load_model(path)
    assert isinstance(reloaded.optimizer, LARS)
    assert reloaded.optimizer.get_config() == model.optimizer.get_config()
    reloaded_lr = keras.optimizers.schedules.deserialize(
        reloaded.optimizer.get_config()["learning_rate"])
    assert isinstance(reloaded_lr, schedules.Warmup)
    # The schedule continues from the saved step (4), still warming up.
    assert int(reloaded.optimizer.iterations) == 4
    assert float(reloaded.optimizer.learning_rate) == float(lr(4)) < 0.5
    np.testing.assert_allclose(reloaded.predict(x, verbose=0),
                               model.predict(x, verbose=0), rtol=1e-6)
    before = [v.numpy() for v in model.optimizer.variables]
    after = [v.numpy() for v in reloaded.optimizer.variables]
    assert len(before) == len(after)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(momentum=-1),
         "`momentum` must be a number in the range [0, 1]. "
         "Received: momentum=-1"),
        (dict(momentum=1.5),
         "`momentum` must be a number in the range [0, 1]. "
         "Received: momentum=1.5"),
        (dict(eeta=-0.001),
         "`eeta` must be a number >= 0. Received: eeta=-0.001"),
        (dict(weight_decay_rate=-1e-4),
         "`weight_decay_rate` must be a number >= 0. "
         "Received: weight_decay_rate=-0.0001"),
        (dict(epsilon=-1),
         "`epsilon` must be a number >= 0. Received: epsilon=-1"),
        (dict(momentum="0.9"),
         "`momentum` must be a number in the range [0, 1]. "
         "Received: momentum='0.9'"),
        (dict(nesterov="yes"),
         "`nesterov` must be a boolean. Received: nesterov='yes'"),
        (dict(exclude_from_weight_decay="bias"),
         "`exclude_from_weight_decay` must be None or a list of regular "
         "expressions (strings). Received: exclude_from_weight_decay='bias'"),
        (dict(exclude_from_layer_adaptation=[1]),
         "`exclude_from_layer_adaptation` must be None or a list of regular "
         "expressions (strings). Received: exclude_from_layer_adaptation=[1]"),
    ],
)
def test_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LARS(**kwargs)


def test_invalid_regex_error():
    with pytest.raises(
        ValueError,
        match=re.escape("`exclude_from_weight_decay` must contain valid "
                        "regular expressions; '(' does not compile"),
    ):
        LARS(exclude_from_weight_decay=["("])


# --------------------------------------------------------------------------
# Mixed precision
# --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_training_keeps_float32_state(policy):
    keras.mixed_precision.set_global_policy(policy)
    model = _small_model()
    model.compile(
        optimizer=LARS(learning_rate=0.5, weight_decay_rate=1e-4),
        loss="sparse_categorical_crossentropy",
    )
    x, y = _data()
    initial = [v.numpy() for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)

    optimizer = model.optimizer
    if policy == "mixed_float16":
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        lars = optimizer.inner_optimizer
    else:
        assert not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        lars = optimizer
    assert isinstance(lars, LARS)
    assert model.layers[1].compute_dtype == policy.split("_")[1]
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert len(lars.momentums) == len(model.trainable_variables)
    assert all(m.dtype == "float32" for m in lars.momentums)
    # The step counter: int64 on TensorFlow, int32 on JAX.
    assert all(v.dtype in ("float32", "int32", "int64") for v in optimizer.variables)
    assert np.isfinite(history.history["loss"]).all()
    for before, v in zip(initial, model.trainable_variables):
        assert np.isfinite(v.numpy()).all()
        assert not np.array_equal(before, v.numpy()), v.path


# --------------------------------------------------------------------------
# The FP16 LARS failure of Jia et al. 2018, and tfscale's FP32 path
# --------------------------------------------------------------------------

_SHAPE = (3, 3, 64, 64)  # a conv kernel: 36864 elements
_LR, _EETA, _MOMENTUM, _SCALE = 20.0, 1e-3, 0.9, 2.0**15


def _with_norm(rng, norm):
    x = rng.standard_normal(_SHAPE)
    return x * (norm / np.linalg.norm(x))


def _naive_fp16_local_lr(w, g):
    """LARS's local learning rate lr * eeta * ||w|| / ||g||, all in float16."""
    f16 = np.float16
    with np.errstate(all="ignore"):
        w16, g16 = w.astype(f16), g.astype(f16)
        w_norm = np.sqrt(np.sum(np.square(w16), dtype=f16))
        g_norm = np.sqrt(np.sum(np.square(g16), dtype=f16))
        return f16(_LR) * f16(_EETA) * w_norm / g_norm


# (||w||, ||g|| of the unscaled gradient, gradient fed to the fp16 LARS,
#  expected fp16 local lr)
_CASES = {
    # ||w||^2 = 2.5e5 > 65504: the weight norm itself overflows.
    "weight_norm_overflows": (500.0, 1.0, "unscaled", np.inf),
    # Unscaled gradient elements ~5e-8 are (sub)normal-or-zero in fp16 and
    # their squares flush to 0: ||g|| = 0, the local lr is inf (and the true
    # one, 2e5, is itself above fp16's max).
    "gradient_norm_underflows": (100.0, 1e-5, "unscaled", np.inf),
    # A loss-scaled gradient of norm ~1e5: ||g||^2 overflows, the local lr
    # is 0 and the layer stops learning (the paper's stalled training).
    "scaled_gradient_norm_overflows": (100.0, 1e5 / _SCALE, "scaled", 0.0),
}


# Keras's LossScaleOptimizer branches with a stateless ops.cond on JAX: there it
# applies inside a traced train step (model.fit, above) but not through the
# eager `apply` used here (keras-team/keras-core#851).
@pytest.mark.skipif(BACKEND == "jax", reason="LossScaleOptimizer.apply outside a "
                    "train step fails on JAX (keras-team/keras-core#851)")
@pytest.mark.parametrize("case", list(_CASES))
def test_fp16_lars_fails_fp32_master_weights_do_not(case):
    w_norm, g_norm, fed, expected_fp16 = _CASES[case]
    rng = np.random.default_rng(3)
    w = _with_norm(rng, w_norm).astype(np.float32)
    g = _with_norm(rng, g_norm)
    # What the mixed_float16 backward pass produces: a loss-scaled float16
    # gradient (cast to float32 for the float32 master weight).
    scaled = (g * _SCALE).astype(np.float16).astype(np.float32)
    assert np.isfinite(scaled).all()

    # 1. Naive: the LARS local learning rate computed in float16.
    naive = _naive_fp16_local_lr(w, scaled if fed == "scaled" else g)
    assert naive == expected_fp16, naive

    # The float64 reference: finite and positive.
    g_true = scaled.astype(np.float64) / _SCALE
    local_lr = _LR * _EETA * np.linalg.norm(w) / np.linalg.norm(g_true)
    assert np.isfinite(local_lr) and local_lr > 0
    ref_w, _ = _reference_step(
        w, g_true, 0.0, lr=_LR, momentum=_MOMENTUM, weight_decay_rate=0.0,
        eeta=_EETA, epsilon=0.0, nesterov=False, decay=False, adapt=True)

    # 2. tfscale: mixed_float16, float32 master weights, LossScaleOptimizer
    #    unscales in float32, LARS runs in float32.
    keras.mixed_precision.set_global_policy("mixed_float16")
    layer = keras.layers.Conv2D(64, 3)
    layer.build((None, 8, 8, 64))
    assert layer.compute_dtype == "float16"
    assert layer.kernel.dtype == "float32"
    layer.kernel.assign(w)
    optimizer = keras.optimizers.LossScaleOptimizer(
        LARS(learning_rate=_LR, momentum=_MOMENTUM, eeta=_EETA),
        initial_scale=_SCALE,
    )
    optimizer.apply(
        [ops.convert_to_tensor(scaled), ops.zeros([64])],
        [layer.kernel, layer.bias],
    )
    new_w = layer.kernel.numpy()
    assert new_w.dtype == np.float32
    assert np.isfinite(new_w).all()
    assert not np.array_equal(new_w, w)
    np.testing.assert_allclose(new_w, ref_w, rtol=1e-5, atol=1e-6)
    # The update itself, up to float32 rounding of the new weight.
    ulp = np.spacing(np.abs(w).max())
    np.testing.assert_allclose(new_w - w, ref_w - w, rtol=1e-4, atol=2 * ulp)
    assert np.linalg.norm(new_w - w) == pytest.approx(
        _LR * _EETA * np.linalg.norm(w), rel=1e-4)
    velocity = optimizer.inner_optimizer.momentums[0]
    assert velocity.dtype == "float32"
