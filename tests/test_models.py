"""Tests for the models package (ResNet-50 v1.5, AlexNet-BN and its small
variant, the name registry)."""

import re

import keras
import numpy as np
import pytest

from tfscale import models

# Small configurations that build and run fast on CPU.
_SMALL = {
    "resnet50": dict(num_classes=4, input_shape=(32, 32, 3)),
    "alexnet_bn": dict(num_classes=4, input_shape=(96, 96, 3), fc_units=32),
    "alexnet_bn_small": dict(num_classes=4, input_shape=(8, 8, 3), width=8),
}
# The regex an optimizer would use to exclude parameters from weight decay.
_NO_DECAY = r"bn|batch_normalization|bias$"


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Restores the global dtype policy and frees graphs after every test."""
    policy = keras.mixed_precision.global_policy()
    yield
    keras.mixed_precision.set_global_policy(policy)
    keras.backend.clear_session()


@pytest.fixture(scope="module")
def small_model():
    """Float32 small models built once per module; tests must not modify them."""
    cache = {}

    def build(name):
        if name not in cache:
            policy = keras.mixed_precision.global_policy()
            keras.mixed_precision.set_global_policy("float32")
            cache[name] = models.get(name, **_SMALL[name])
            keras.mixed_precision.set_global_policy(policy)
        return cache[name]

    return build


def _count(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


def _stage_outputs(model):
    return {
        stage: model.get_layer(f"{stage}_block1_out").output.shape[1:3]
        for stage in ("conv2", "conv3", "conv4", "conv5")
    }


# ---------------------------------------------------------------- ResNet-50


def test_resnet50_parameter_counts():
    model = models.resnet50()
    assert _count(model.trainable_weights) == 25_557_032
    assert _count(model.non_trainable_weights) == 53_120
    assert model.count_params() == 25_557_032 + 53_120
    assert model.output.shape == (None, 1000)
    assert _stage_outputs(model) == {
        "conv2": (56, 56),
        "conv3": (28, 28),
        "conv4": (14, 14),
        "conv5": (7, 7),
    }


def test_resnet50_v1_5_stride_on_3x3_conv(small_model):
    model = small_model("resnet50")
    strided = {
        layer.name
        for layer in model.layers
        if isinstance(layer, keras.layers.Conv2D) and tuple(layer.strides) != (1, 1)
    }
    # Stem, then per downsampling stage the 3x3 conv and the projection shortcut.
    assert strided == {
        "conv1_conv",
        "conv3_block1_2_conv",
        "conv3_block1_0_conv",
        "conv4_block1_2_conv",
        "conv4_block1_0_conv",
        "conv5_block1_2_conv",
        "conv5_block1_0_conv",
    }
    assert model.get_layer("conv3_block1_2_conv").kernel_size == (3, 3)
    assert model.get_layer("conv3_block1_1_conv").strides == (1, 1)
    # One projection shortcut per stage, none in the other blocks.
    projections = [l.name for l in model.layers if l.name.endswith("_0_conv")]
    assert sorted(projections) == [f"conv{s}_block1_0_conv" for s in (2, 3, 4, 5)]


def test_resnet50_zero_init_last_bn_gamma(small_model):
    model = models.resnet50(zero_init_last_bn_gamma=True, **_SMALL["resnet50"])
    bns = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    zero = {l.name for l in bns if not np.any(l.gamma.numpy())}
    assert zero == {l.name for l in bns if l.name.endswith("_3_bn")}
    assert len(zero) == 3 + 4 + 6 + 3
    others = [l for l in bns if l.name not in zero]
    assert all(np.all(l.gamma.numpy() == 1) for l in others)

    # Off by default: every gamma starts at one.
    for layer in small_model("resnet50").layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            np.testing.assert_array_equal(layer.gamma.numpy(), 1)


# ---------------------------------------------------------------- AlexNet-BN


def test_alexnet_bn_parameter_counts():
    model = models.alexnet_bn()
    assert _count(model.trainable_weights) == 62_380_232
    assert _count(model.non_trainable_weights) == 3_264
    assert model.count_params() == 62_383_496
    assert model.get_layer("pool5").output.shape == (None, 6, 6, 256)
    assert model.output.shape == (None, 1000)
    # At 224 x 224 (the training benchmarks' input) pool5 is 5 x 5: fc6,
    # and so every step's gradients, shrink (BENCHMARKS.md, section
    # "Training throughput: tfscale, stock and Keras on JAX").
    at_224 = models.alexnet_bn(input_shape=(224, 224, 3))
    assert at_224.get_layer("pool5").output.shape == (None, 5, 5, 256)
    assert _count(at_224.trainable_weights) == 50_845_896


def test_alexnet_bn_batchnorm_after_every_conv_and_pool5(small_model):
    model = small_model("alexnet_bn")
    layers = model.layers
    for i, layer in enumerate(layers):
        if isinstance(layer, keras.layers.Conv2D):
            assert not layer.use_bias, layer.name
            assert isinstance(layers[i + 1], keras.layers.BatchNormalization)
    pool5_bn = model.get_layer("pool5_bn")
    assert isinstance(pool5_bn, keras.layers.BatchNormalization)
    assert pool5_bn.input is model.get_layer("pool5").output
    assert model.get_layer("flatten").input is pool5_bn.output
    assert model.get_layer("pool5").output.shape == (None, 1, 1, 256)


def test_alexnet_bn_rejects_input_too_small_for_pool5():
    models.alexnet_bn(num_classes=4, input_shape=(67, 67, 3), fc_units=8)
    with pytest.raises(
        ValueError,
        match=r"at least 67\. Received: input_shape=\(66, 96, 3\)",
    ):
        models.alexnet_bn(num_classes=4, input_shape=(66, 96, 3), fc_units=8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dropout=1.0), r"must be a number in \[0, 1\)\. Received: dropout=1\.0"),
        (dict(fc_units=0), r"Received: fc_units=0"),
        (dict(num_classes=-1), r"Received: num_classes=-1"),
        (dict(input_shape=(96, 96)), r"Received: input_shape=\(96, 96\)"),
    ],
)
def test_alexnet_bn_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        models.alexnet_bn(**kwargs)


# ---------------------------------------------------------- AlexNet-BN small


def test_alexnet_bn_small_output_shape_and_dtype():
    model = models.alexnet_bn_small()
    assert model.name == "alexnet_bn_small"
    assert model.input.shape == (None, 8, 8, 1)
    assert model.get_layer("pool2").output.shape == (None, 2, 2, 64)
    assert model.output.shape == (None, 10)
    logits = model(np.zeros((3, 8, 8, 1), "float32"), training=False)
    assert logits.shape == (3, 10)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"


def test_alexnet_bn_small_parameter_counts():
    model = models.alexnet_bn_small()
    # Defaults: 8x8x1 input, width 32, fc_units 64, 10 classes. Convolutions
    # have no bias; each BN has gamma + beta (trainable) and moving mean +
    # variance (not) per channel:
    #   conv1 3*3*1*32 = 288; conv1_bn 2*32 = 64
    #   conv2 3*3*32*64 = 18,432; conv2_bn 2*64 = 128
    #   pool_bn (after pool2, 2x2x64) 2*64 = 128
    #   fc1 (2*2*64 = 256 inputs) 256*64 + 64 = 16,448; fc2 64*10 + 10 = 650
    #   trainable: 288 + 64 + 18,432 + 128 + 128 + 16,448 + 650 = 36,138
    #   non-trainable: 2*32 + 2*64 + 2*64 = 320
    assert _count(model.trainable_weights) == 36_138
    assert _count(model.non_trainable_weights) == 320
    assert model.count_params() == 36_458


def test_alexnet_bn_small_batchnorm_settings():
    model = models.alexnet_bn_small()
    bns = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert [l.name for l in bns] == ["conv1_bn", "conv2_bn", "pool_bn"]
    # Momentum 0.9 as alexnet_bn, but Keras's default epsilon (alexnet_bn:
    # 1e-5): what docs/large_batch.md was measured with.
    for layer in bns:
        assert layer.momentum == 0.9, layer.name
        assert layer.epsilon == 1e-3, layer.name
    assert model.get_layer("pool_bn").input is model.get_layer("pool2").output
    assert model.get_layer("flatten").input is model.get_layer("pool_bn").output


def test_alexnet_bn_small_smallest_input():
    models.alexnet_bn_small(input_shape=(4, 4, 1))
    with pytest.raises(
        ValueError, match=r"at least 4\. Received: input_shape=\(3, 8, 1\)"
    ):
        models.alexnet_bn_small(input_shape=(3, 8, 1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_classes=0), r"Received: num_classes=0"),
        (dict(width=0), r"Received: width=0"),
        (dict(width=2.0), r"Received: width=2\.0"),
        (dict(fc_units=True), r"Received: fc_units=True"),
        (dict(input_shape=(8, 8)), r"Received: input_shape=\(8, 8\)"),
    ],
)
def test_alexnet_bn_small_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        models.alexnet_bn_small(**kwargs)


# ---------------------------------------------------------------- All models


@pytest.mark.parametrize(
    "name, input_shape",
    [
        ("alexnet_bn", (96, 96, 1)),
        # ResNet-50 is fully convolutional up to global pooling: any size works.
        ("resnet50", (None, None, 1)),
    ],
)
def test_grayscale_input(name, input_shape):
    model = models.get(name, **dict(_SMALL[name], input_shape=input_shape))
    first_conv = next(l for l in model.layers if isinstance(l, keras.layers.Conv2D))
    assert first_conv.kernel.shape[2] == 1
    x = np.zeros((1,) + _SMALL[name]["input_shape"][:2] + (1,), "float32")
    assert model(x, training=False).shape == (1, 4)


@pytest.mark.parametrize("name", models.names())
def test_no_decay_regex_selects_bn_and_biases_only(name, small_model):
    model = small_model(name)
    for v in model.trainable_variables:
        layer = model.get_layer(v.path.split("/")[0])
        is_bn = isinstance(layer, keras.layers.BatchNormalization)
        is_bias = v.name == "bias"
        assert bool(re.search(_NO_DECAY, v.path)) == (is_bn or is_bias), v.path
        if is_bias:
            assert isinstance(layer, keras.layers.Dense), v.path
    # Convolutions carry no bias: BN's beta replaces it.
    assert all(
        not l.use_bias for l in model.layers if isinstance(l, keras.layers.Conv2D)
    )


@pytest.mark.parametrize(
    "policy, half", [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")]
)
@pytest.mark.parametrize("name", models.names())
def test_mixed_precision(name, policy, half):
    keras.mixed_precision.set_global_policy(policy)
    model = models.get(name, **_SMALL[name])
    assert {v.dtype for v in model.weights} == {"float32"}
    first_conv = next(l for l in model.layers if isinstance(l, keras.layers.Conv2D))
    assert first_conv.compute_dtype == half
    assert first_conv.output.dtype == half
    if name == "alexnet_bn_small":
        # Its final Dense computes in float32 itself (no "logits" cast layer).
        assert model.get_layer("fc1").output.dtype == half
        assert model.get_layer("fc2").compute_dtype == "float32"
    else:
        assert model.get_layer("logits").input.dtype == half  # final Dense too
    assert model.output.dtype == "float32"
    x = np.random.default_rng(0).random((2,) + _SMALL[name]["input_shape"], "float32")
    logits = model(x, training=False)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(logits)))


@pytest.mark.parametrize(
    "name, kwargs, policy, steps, run_eagerly",
    [
        # Eager: tracing ResNet-50's train step costs ~12 s on CPU, two eager
        # steps ~5 s.
        ("resnet50", dict(zero_init_last_bn_gamma=True), "float32", 2, True),
        ("alexnet_bn", dict(dropout=0.0), "float32", 5, False),
    ],
)
def test_training_reduces_loss(name, kwargs, policy, steps, run_eagerly):
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(policy)
    model = models.get(name, **_SMALL[name], **kwargs)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=loss,
        run_eagerly=run_eagerly,
    )
    x = np.random.default_rng(0).random((8,) + _SMALL[name]["input_shape"], "float32")
    y = np.arange(8) % 4
    # train_on_batch returns the loss before its update. Measure after in training
    # mode too: BN then uses batch statistics, not the lagging moving averages.
    before = float(model.train_on_batch(x, y))
    for _ in range(steps - 1):
        model.train_on_batch(x, y)
    after = float(loss(y, model(x, training=True)))
    assert np.isfinite(after)
    assert after < 0.9 * before, (before, after)


# Raised inside Keras' saving code (numpy 2 __array__ protocol), not ours.
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_alexnet_bn_serialization_round_trip(tmp_path, small_model):
    model = small_model("alexnet_bn")
    path = tmp_path / "alexnet_bn.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert restored.count_params() == model.count_params()
    x = np.random.default_rng(0).random((2, 96, 96, 3), "float32")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(restored(x, training=False)),
        keras.ops.convert_to_numpy(model(x, training=False)),
        rtol=1e-6,
        atol=1e-6,
    )


# ---------------------------------------------------------------- Registry


@pytest.mark.parametrize("name", ["alexnet_bn", "alexnet_bn_small", "resnet50"])
def test_names_and_get(name, small_model):
    assert models.names() == ["alexnet_bn", "alexnet_bn_small", "resnet50"]
    assert small_model(name).name == name  # small_model builds through get().


def test_get_unknown_name():
    with pytest.raises(
        ValueError,
        match=r"^Unknown model name: 'vgg'\. Known: alexnet_bn, alexnet_bn_small, "
        r"resnet50$",
    ):
        models.get("vgg")
