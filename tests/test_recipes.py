"""Tests for tfscale/recipes.py: Settings, their file, optimizer, schedule."""

import json
import os

import keras
import numpy as np
import pytest

import tfscale
from tfscale import recipes
from tfscale import schedules


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def lr_at(learning_rate, step):
    if isinstance(learning_rate, float):
        return learning_rate
    return float(learning_rate(step))


def test_default_settings_give_plain_sgd():
    optimizer, learning_rate = recipes.make_optimizer(
        recipes.Settings(), 64, 22, 8)
    assert type(optimizer) is keras.optimizers.SGD
    assert learning_rate == 0.05
    assert optimizer.get_config()["momentum"] == 0.9
    assert optimizer.get_config()["nesterov"] is False


def test_sgd_weight_decay_is_l2_on_the_gradient_except_bias():
    settings = recipes.Settings(weight_decay=0.1, learning_rate=0.5)
    optimizer, _ = recipes.make_optimizer(settings, 8, 1, 1)
    kernel = keras.Variable(np.array([[1.0, -2.0], [3.0, 0.5]]), name="kernel")
    bias = keras.Variable(np.array([1.0, 2.0]), name="bias")
    grads = [np.array([[0.1, 0.2], [0.3, 0.4]]), np.array([0.5, -0.5])]
    # float64 reference: v = m * v + lr * (g + wd * w); w = w - v.
    w = [kernel.numpy().astype(np.float64), bias.numpy().astype(np.float64)]
    v = [np.zeros_like(w[0]), np.zeros_like(w[1])]
    for _ in range(3):
        optimizer.apply([np.float32(g) for g in grads], [kernel, bias])
        for i, decay in ((0, 0.1), (1, 0.0)):
            v[i] = 0.9 * v[i] + 0.5 * (grads[i] + decay * w[i])
            w[i] = w[i] - v[i]
    np.testing.assert_allclose(kernel.numpy(), w[0], rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), w[1], rtol=1e-6)


def test_lars_settings():
    settings = recipes.Settings(optimizer="lars", weight_decay=1e-4,
                                eeta=0.002, lars_epsilon=1e-5, momentum=0.8)
    optimizer, _ = recipes.make_optimizer(settings, 64, 10, 3)
    assert type(optimizer) is tfscale.optimizers.LARS
    config = optimizer.get_config()
    assert (config["weight_decay_rate"], config["eeta"], config["epsilon"],
            config["momentum"]) == (1e-4, 0.002, 1e-5, 0.8)
    # Biases and BatchNorm: the LARS defaults.
    assert config["exclude_from_weight_decay"] is None
    assert config["exclude_from_layer_adaptation"] is None


@pytest.mark.parametrize("optimizer_name", ["sgd", "lars"])
def test_only_mixed_float16_gets_loss_scaling(optimizer_name):
    for precision, wrapped in (("float32", False), ("mixed_bfloat16", False),
                               ("mixed_float16", True)):
        settings = recipes.Settings(optimizer=optimizer_name,
                                    precision=precision)
        optimizer, _ = recipes.make_optimizer(settings, 64, 10, 2)
        assert isinstance(optimizer,
                          tfscale.optimizers.LossScaleOptimizer) == wrapped


def test_warmup_poly_with_linear_scaling():
    settings = recipes.Settings(
        lr_schedule="warmup_poly", learning_rate=0.1, scale_lr=True,
        base_batch_size=256, warmup_epochs=1, end_learning_rate=0.001)
    schedule = recipes.make_schedule(settings, 1024, 10, 5)
    assert isinstance(schedule, schedules.WarmupPolynomialDecay)
    peak = 0.1 * 1024 / 256
    assert lr_at(schedule, 0) == 0.0
    assert lr_at(schedule, 5) == pytest.approx(peak / 2)
    assert lr_at(schedule, 10) == pytest.approx(peak)
    # Halfway through the 40 decay steps: (peak - end) * 0.5**2 + end.
    assert lr_at(schedule, 30) == pytest.approx((peak - 0.001) * 0.25 + 0.001)
    assert lr_at(schedule, 50) == pytest.approx(0.001)


def test_constant_with_warmup():
    settings = recipes.Settings(warmup_epochs=2, learning_rate=0.3)
    schedule = recipes.make_schedule(settings, 64, 5, 4)
    assert isinstance(schedule, schedules.Warmup)
    assert [lr_at(schedule, s) for s in (0, 5, 10, 19)] == pytest.approx(
        [0.0, 0.15, 0.3, 0.3])


def test_one_cycle_peaks_at_the_end_of_warmup():
    settings = recipes.Settings(lr_schedule="one_cycle", learning_rate=0.8,
                                warmup_epochs=1)
    schedule = recipes.make_schedule(settings, 64, 10, 4)
    assert isinstance(schedule, schedules.OneCycle)
    assert schedule.pct_start == 0.25
    assert lr_at(schedule, 0) == pytest.approx(0.8 / 25)
    assert lr_at(schedule, 9) == pytest.approx(0.8)  # pct_start * 40 - 1
    default = recipes.make_schedule(
        recipes.Settings(lr_schedule="one_cycle"), 64, 10, 4)
    assert default.pct_start == 0.3


@pytest.mark.parametrize("schedule", ["warmup_poly", "one_cycle"])
def test_warmup_longer_than_training_is_refused(schedule):
    settings = recipes.Settings(lr_schedule=schedule, warmup_epochs=3)
    with pytest.raises(ValueError, match=(
            r"`warmup_epochs` must be shorter than training for "
            rf"lr_schedule='{schedule}'. Received: warmup_epochs=3.0, "
            r"epochs=3")):
        recipes.make_schedule(settings, 64, 10, 3)


def test_recipe_values():
    """The published numbers, as cited in tfscale/recipes.py."""
    r = recipes.RECIPES["resnet50_lars_32k"]
    assert (r["learning_rate"], r["warmup_epochs"], r["weight_decay"],
            r["base_batch_size"], r["lars_epsilon"],
            r["end_learning_rate"]) == (31.2, 25.0, 1e-4, 32768, 1e-5, 1e-4)
    r = recipes.RECIPES["resnet50_lars_4k"]
    assert (r["learning_rate"], r["warmup_epochs"], r["weight_decay"],
            r["base_batch_size"]) == (10.0, 5.0, 2e-4, 4096)
    r = recipes.RECIPES["alexnet_bn_lars_8k"]
    assert (r["learning_rate"], r["weight_decay"], r["warmup_epochs"],
            r["base_batch_size"]) == (10.0, 5e-4, 3.84, 8192)
    r = recipes.RECIPES["alexnet_bn_lars_32k"]
    assert (r["learning_rate"], r["warmup_epochs"]) == (32.0, 10.23)
    for recipe in recipes.RECIPES.values():
        recipes.Settings(**recipe)  # every key is a valid setting


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_every_recipe_builds_lars_and_its_schedule_and_takes_a_lars_step(name):
    """On every Keras backend: the JAX tier (.ci/jax) runs this module too."""
    settings = recipes.Settings.from_recipe(name, scale_lr=True)
    optimizer, learning_rate = recipes.make_optimizer(settings, 1024, 10, 30)
    assert type(optimizer) is tfscale.optimizers.LARS
    assert isinstance(learning_rate, schedules.WarmupPolynomialDecay)
    peak = settings.peak_learning_rate(1024)
    warmup = schedules.epochs_to_steps(settings.warmup_epochs, 10)
    assert lr_at(learning_rate, 0) == 0.0
    assert lr_at(learning_rate, warmup) == pytest.approx(peak)
    # The first step at the peak moves a kernel by lr * eeta * ||w||: the
    # trust ratio's step (momentum has nothing to add yet).
    kernel = keras.Variable(np.ones((3, 2), np.float32), name="kernel")
    optimizer.build([kernel])
    optimizer.iterations.assign(warmup)
    optimizer.apply([np.full((3, 2), 0.5, np.float32)], [kernel])
    moved = np.linalg.norm(kernel.numpy() - 1.0)
    assert moved == pytest.approx(peak * settings.eeta * np.sqrt(6), rel=1e-3)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=(
            r"`optimizer` must be one of \['sgd', 'lars', 'rmsprop_warmup'\]. "
            r"Received: optimizer='adam'")):
        recipes.Settings(optimizer="adam")
    with pytest.raises(ValueError, match=r"Received: precision='float16'"):
        recipes.Settings(precision="float16")
    with pytest.raises(ValueError, match=(
            r"`learning_rate` must be a number > 0. Received: learning_rate=0")):
        recipes.Settings(learning_rate=0)
    with pytest.raises(ValueError, match=(
            r"`momentum` must be a number in \[0, 1\]. Received: momentum=1.5")):
        recipes.Settings(momentum=1.5)
    with pytest.raises(ValueError, match=(
            r"`weight_decay` must be a number >= 0. Received: weight_decay=True")):
        recipes.Settings(weight_decay=True)
    with pytest.raises(ValueError, match=(
            r"`base_batch_size` must be an integer >= 1. "
            r"Received: base_batch_size=256.0")):
        recipes.Settings(base_batch_size=256.0)
    with pytest.raises(ValueError, match=(
            r"`accumulation_steps` must be an integer >= 1. "
            r"Received: accumulation_steps=0")):
        recipes.Settings(accumulation_steps=0)
    with pytest.raises(ValueError, match=(
            r"`scale_lr` must be a boolean. Received: scale_lr='yes'")):
        recipes.Settings(scale_lr="yes")
    with pytest.raises(ValueError, match=(
            r"`rmsprop_warmup_period_epochs` must be a number > 0. "
            r"Received: rmsprop_warmup_period_epochs=0")):
        recipes.Settings(rmsprop_warmup_period_epochs=0)


def test_sgd_with_weight_decay_is_not_named_sgd():
    optimizer, _ = recipes.make_optimizer(
        recipes.Settings(weight_decay=1e-4), 64, 10, 2)
    assert type(optimizer) is tfscale.optimizers.LARS
    assert optimizer.name == "LARS"


def test_settings_round_trip_through_json():
    settings = recipes.Settings.from_recipe(
        "resnet50_lars_32k", scale_lr=True, precision="mixed_bfloat16")
    config = json.loads(json.dumps(settings.get_config()))
    assert recipes.Settings.from_config(config) == settings
    assert recipes.Settings.from_config(config).get_config() == config
    # Integers given for float fields come back as the same floats.
    assert recipes.Settings(learning_rate=10).get_config()["learning_rate"] == 10.0
    assert type(recipes.Settings(learning_rate=10).learning_rate) is float


def test_from_recipe_takes_the_recipe_and_overrides():
    settings = recipes.Settings.from_recipe("alexnet_bn_lars_8k",
                                            warmup_epochs=1.0)
    recipe = recipes.RECIPES["alexnet_bn_lars_8k"]
    assert settings.recipe == "alexnet_bn_lars_8k"
    assert settings.warmup_epochs == 1.0
    assert settings.learning_rate == recipe["learning_rate"]
    assert settings.precision == recipes.Settings().precision  # not in it
    with pytest.raises(ValueError, match=(
            r"`name` must be one of \['resnet50_lars_32k', .*\]. "
            r"Received: name='resnet50_lars_64k'")):
        recipes.Settings.from_recipe("resnet50_lars_64k")
    with pytest.raises(ValueError, match=(
            r"`config` must hold only Settings fields \(optimizer, .*\). "
            r"Received: config with label_smoothing")):
        recipes.Settings.from_recipe("resnet50_lars_4k", label_smoothing=0.1)


def test_set_precision_and_describe():
    settings = recipes.Settings(precision="mixed_float16", scale_lr=True,
                                learning_rate=0.1, optimizer="lars")
    recipes.set_precision(settings)
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    assert recipes.describe(settings, 1024) == (
        "optimizer lars (momentum 0.9, eeta 0.001), lr constant 0.4 "
        "(= 0.1 x 1024/256), precision mixed_float16 with dynamic loss "
        "scaling")
    assert recipes.describe(settings) == (
        "optimizer lars (momentum 0.9, eeta 0.001), lr constant 0.1 x "
        "batch/256, precision mixed_float16 with dynamic loss scaling")


def test_settings_file_round_trip(tmp_path):
    settings = recipes.Settings.from_recipe("resnet50_lars_4k")
    recipes.write_settings(str(tmp_path / "run"), settings, model="resnet50",
                           global_batch_size=4096)
    assert os.listdir(tmp_path / "run") == [recipes.SETTINGS_FILE]  # no tmp
    assert recipes.read_settings(str(tmp_path / "run")) == (
        settings, {"model": "resnet50", "global_batch_size": 4096})
    with pytest.raises(FileNotFoundError):
        recipes.read_settings(str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=(
            r"`training` must not repeat Settings fields. "
            r"Received: learning_rate=1.0")):
        recipes.write_settings(str(tmp_path), settings, learning_rate=1.0)


def test_settings_differences_name_each_change():
    saved = (recipes.Settings(), {"model": "alexnet_bn", "epochs": 10})
    current = (recipes.Settings(learning_rate=0.1),
               {"model": "alexnet_bn", "epochs": 12, "seed": 1})
    assert recipes.settings_differences(saved, current) == [
        "epochs: 10 saved, 12 now",
        "learning_rate: 0.05 saved, 0.1 now",
        "seed: '<unset>' saved, 1 now",
    ]
    assert recipes.settings_differences(saved, saved) == []


def test_a_training_value_missing_from_an_older_file_counts_as_its_default():
    # Written before `--bn_statistics_batches` existed.
    saved = (recipes.Settings(), {"epochs": 10})
    defaults = {"bn_statistics_batches": 0}
    at_default = (recipes.Settings(), {"epochs": 10, "bn_statistics_batches": 0})
    assert recipes.settings_differences(saved, at_default, defaults) == []
    changed = (recipes.Settings(), {"epochs": 10, "bn_statistics_batches": 4})
    assert recipes.settings_differences(saved, changed, defaults) == [
        "bn_statistics_batches: 0 saved, 4 now"]
    assert recipes.settings_differences(saved, at_default) == [
        "bn_statistics_batches: '<unset>' saved, 0 now"]


def test_resuming_with_other_settings_is_refused(tmp_path):
    directory = str(tmp_path)
    settings = recipes.Settings(optimizer="lars")
    # Nothing saved yet: nothing to compare.
    recipes.check_settings_unchanged(directory, settings, global_batch_size=64)
    recipes.write_settings(directory, settings, global_batch_size=64)
    recipes.check_settings_unchanged(directory, settings, global_batch_size=64)
    with pytest.raises(recipes.SettingsChangedError) as raised:
        recipes.check_settings_unchanged(
            directory, recipes.Settings(optimizer="lars", warmup_epochs=1.0),
            global_batch_size=128)
    assert str(raised.value) == (
        f"The checkpoints in {directory} were written with other settings; "
        "resume with the settings they were written with, or train in "
        "another directory:\n"
        "  global_batch_size: 64 saved, 128 now\n"
        "  warmup_epochs: 0.0 saved, 1.0 now")
    assert "--" not in str(raised.value)  # the library names no flags


def test_rmsprop_warmup_with_slow_start():
    """Akiba et al.'s optimizer and schedule from Settings: the switch
    counted in epochs becomes steps, the schedule spans the training."""
    settings = recipes.Settings(
        optimizer="rmsprop_warmup", lr_schedule="slow_start",
        learning_rate=0.1, scale_lr=True, base_batch_size=256, momentum=0.9,
        rmsprop_learning_rate=1e-3, rmsprop_warmup_center_epochs=2,
        rmsprop_warmup_period_epochs=1, weight_decay=1e-4)
    optimizer, schedule = recipes.make_optimizer(settings, 32768, 10, 9)
    assert type(optimizer) is tfscale.optimizers.RMSpropWarmup
    config = optimizer.get_config()
    assert (config["rmsprop_learning_rate"], config["mu1"],
            config["beta_center"], config["beta_period"],
            config["weight_decay_rate"]) == (1e-3, 0.9, 20.0, 10.0, 1e-4)
    assert isinstance(schedule, schedules.SlowStart)
    assert schedule.total_steps == 90 and schedule.boundaries() == [40, 70, 85]
    assert float(schedule(0)) == pytest.approx(6.4)  # 0.5 * 0.1 * 32768 / 256
    assert recipes.describe(settings, 32768) == (
        "optimizer rmsprop_warmup (momentum 0.9, weight decay 0.0001 except "
        "bias/BN, from RMSprop at lr 0.001 to SGD: half at epoch 2, SGD alone "
        "from epoch 2.5), lr slow_start 12.8 (= 0.1 x 32768/256), precision "
        "float32")
    # With a linear warmup in front.
    _, warmed = recipes.make_optimizer(
        recipes.Settings(lr_schedule="slow_start", warmup_epochs=1), 64, 10, 9)
    assert isinstance(warmed, schedules.Warmup)
    assert [float(warmed(s)) for s in (0, 5, 10)] == pytest.approx(
        [0.0, 0.0125, 0.025])
