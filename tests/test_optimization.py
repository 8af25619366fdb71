"""Tests for launch/optimization.py: flags -> optimizer, schedule, precision."""

import keras
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

import launch.train  # noqa: F401  (defines --learning_rate, --momentum)
import tfscale
from launch import optimization
from tfscale import schedules

FLAGS = flags.FLAGS


@pytest.fixture(autouse=True)
def _clean_state():
    with flagsaver.flagsaver():
        yield
    FLAGS.unparse_flags()
    keras.mixed_precision.set_global_policy("float32")


def parse(*args):
    FLAGS.unparse_flags()
    FLAGS(["tfscale-train", *args])
    return optimization.settings_from_flags()


def lr_at(learning_rate, step):
    if isinstance(learning_rate, float):
        return learning_rate
    return float(learning_rate(step))


def test_defaults_are_todays_sgd():
    settings = parse()
    assert settings == optimization.Settings()
    optimizer, learning_rate = optimization.build_optimizer(64, 22, 8)
    assert type(optimizer) is keras.optimizers.SGD
    assert learning_rate == 0.05
    assert optimizer.get_config()["momentum"] == 0.9
    assert float(optimizer.learning_rate) == pytest.approx(0.05)
    assert optimization.describe(64) == (
        "optimizer sgd (momentum 0.9), lr constant 0.05, precision float32")


def test_lars_flags_reach_the_optimizer():
    parse("--optimizer=lars", "--weight_decay=1e-4", "--eeta=0.002",
          "--lars_epsilon=1e-5", "--momentum=0.8", "--learning_rate=2")
    optimizer, learning_rate = optimization.build_optimizer(64, 10, 3)
    assert type(optimizer) is tfscale.optimizers.LARS
    config = optimizer.get_config()
    assert config["weight_decay_rate"] == 1e-4
    assert config["eeta"] == 0.002
    assert config["epsilon"] == 1e-5
    assert config["momentum"] == 0.8
    assert config["exclude_from_weight_decay"] is None
    assert config["exclude_from_layer_adaptation"] is None
    assert learning_rate == 2.0


def test_sgd_weight_decay_is_l2_on_the_gradient_except_bias():
    parse("--weight_decay=0.1", "--learning_rate=0.5", "--momentum=0.9")
    optimizer, _ = optimization.build_optimizer(8, 1, 1)
    kernel = keras.Variable(np.array([[1.0, -2.0], [3.0, 0.5]]), name="kernel")
    bias = keras.Variable(np.array([1.0, 2.0]), name="bias")
    grads = [np.array([[0.1, 0.2], [0.3, 0.4]]), np.array([0.5, -0.5])]
    w = [kernel.numpy().astype(np.float64), bias.numpy().astype(np.float64)]
    v = [np.zeros_like(w[0]), np.zeros_like(w[1])]
    for _ in range(3):
        optimizer.apply([np.float32(g) for g in grads], [kernel, bias])
        for i, decay in ((0, 0.1), (1, 0.0)):
            v[i] = 0.9 * v[i] + 0.5 * (grads[i] + decay * w[i])
            w[i] = w[i] - v[i]
    np.testing.assert_allclose(kernel.numpy(), w[0], rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), w[1], rtol=1e-6)


@pytest.mark.parametrize("optimizer_flag", ["sgd", "lars"])
def test_mixed_float16_wraps_in_tfscale_loss_scale(optimizer_flag):
    parse(f"--optimizer={optimizer_flag}", "--precision=mixed_float16")
    optimization.set_precision()
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    optimizer, _ = optimization.build_optimizer(64, 10, 2)
    assert type(optimizer) is tfscale.optimizers.LossScaleOptimizer
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer  # compile did not wrap it again


def test_mixed_bfloat16_needs_no_loss_scaling():
    parse("--optimizer=lars", "--precision=mixed_bfloat16")
    optimization.set_precision()
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    optimizer, _ = optimization.build_optimizer(64, 10, 2)
    assert type(optimizer) is tfscale.optimizers.LARS


def test_warmup_poly_with_linear_scaling():
    parse("--lr_schedule=warmup_poly", "--learning_rate=0.1", "--scale_lr",
          "--base_batch_size=256", "--warmup_epochs=1", "--poly_power=2",
          "--end_learning_rate=0.001")
    _, schedule = optimization.build_optimizer(1024, 10, 5)
    assert isinstance(schedule, schedules.WarmupPolynomialDecay)
    peak = 0.1 * 1024 / 256
    assert lr_at(schedule, 0) == 0.0
    assert lr_at(schedule, 5) == pytest.approx(peak / 2)
    assert lr_at(schedule, 10) == pytest.approx(peak)
    # Halfway through the 40 decay steps: (peak - end) * 0.5**2 + end.
    assert lr_at(schedule, 30) == pytest.approx(
        (peak - 0.001) * 0.25 + 0.001)
    assert lr_at(schedule, 50) == pytest.approx(0.001)


def test_constant_with_warmup():
    parse("--warmup_epochs=2", "--learning_rate=0.3")
    _, schedule = optimization.build_optimizer(64, 5, 4)
    assert isinstance(schedule, schedules.Warmup)
    assert lr_at(schedule, 0) == 0.0
    assert lr_at(schedule, 5) == pytest.approx(0.15)
    assert lr_at(schedule, 10) == pytest.approx(0.3)
    assert lr_at(schedule, 19) == pytest.approx(0.3)


def test_one_cycle_peaks_at_the_end_of_warmup():
    parse("--lr_schedule=one_cycle", "--learning_rate=0.8",
          "--warmup_epochs=1")
    _, schedule = optimization.build_optimizer(64, 10, 4)
    assert isinstance(schedule, schedules.OneCycle)
    assert schedule.pct_start == 0.25
    assert lr_at(schedule, 0) == pytest.approx(0.8 / 25)
    assert lr_at(schedule, 9) == pytest.approx(0.8)  # pct_start * 40 - 1


@pytest.mark.parametrize("name", sorted(optimization.RECIPES))
def test_recipes_load_and_build(name):
    recipe = optimization.RECIPES[name]
    settings = parse(f"--recipe={name}")
    for key, value in recipe.items():
        assert getattr(settings, key) == value, key
    assert settings.optimizer == "lars"
    assert settings.lr_schedule == "warmup_poly"
    # At the published batch the scaled learning rate is the published one.
    settings = parse(f"--recipe={name}", "--scale_lr")
    batch = recipe["base_batch_size"]
    assert settings.peak_learning_rate(batch) == recipe["learning_rate"]
    optimizer, schedule = optimization.build_optimizer(batch, 40, 90)
    assert type(optimizer) is tfscale.optimizers.LARS
    warmup = schedules.epochs_to_steps(recipe["warmup_epochs"], 40)
    assert lr_at(schedule, warmup) == pytest.approx(recipe["learning_rate"])
    assert name in optimization.describe(batch)


def test_recipe_values():
    """The published numbers, as cited in launch/optimization.py."""
    resnet = optimization.RECIPES["resnet50_lars_32k"]
    assert (resnet["learning_rate"], resnet["warmup_epochs"],
            resnet["weight_decay"], resnet["base_batch_size"]) == (
                31.2, 25.0, 1e-4, 32768)
    alexnet = optimization.RECIPES["alexnet_bn_lars_8k"]
    assert (alexnet["learning_rate"], alexnet["weight_decay"],
            alexnet["warmup_epochs"]) == (10.0, 5e-4, 3.84)


def test_explicit_flags_override_the_recipe():
    settings = parse("--recipe=resnet50_lars_32k", "--learning_rate=20",
                     "--warmup_epochs=2", "--precision=mixed_bfloat16",
                     "--scale_lr")
    assert settings.learning_rate == 20.0
    assert settings.warmup_epochs == 2.0
    assert settings.weight_decay == 1e-4  # from the recipe
    assert settings.precision == "mixed_bfloat16"
    assert settings.peak_learning_rate(8192) == pytest.approx(5.0)
    assert optimization.describe(8192) == (
        "optimizer lars (momentum 0.9, weight decay 0.0001 except bias/BN, "
        "eeta 0.001, epsilon 1e-05), lr warmup_poly 5 (= 20 x 8192/32768), "
        "warmup 2 epochs, power 2 to 0.0001, precision mixed_bfloat16, "
        "recipe resnet50_lars_32k")


def test_warmup_longer_than_training_is_refused():
    parse("--lr_schedule=warmup_poly", "--warmup_epochs=3")
    with pytest.raises(ValueError, match=r"`warmup_epochs` must be shorter "
                       r"than training .*Received: warmup_epochs=3.0, "
                       r"epochs=3"):
        optimization.build_optimizer(64, 10, 3)


def test_bad_values_are_refused():
    with pytest.raises(flags.IllegalFlagValueError, match="precision"):
        parse("--precision=float16")
    with pytest.raises(flags.IllegalFlagValueError, match="weight_decay"):
        parse("--weight_decay=-1")
    with pytest.raises(ValueError,
                       match=r"Received: optimizer='adam'"):
        optimization.Settings(optimizer="adam")
    with pytest.raises(ValueError, match=r"Received: learning_rate=0"):
        optimization.Settings(learning_rate=0)
