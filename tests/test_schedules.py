"""Tests for tfscale.schedules: pinned values, tf.function, serialization,
argument errors."""

import json
import math
import re

import keras
import numpy as np
import pytest

from keras_backend import tensorflow_only
from tfscale import schedules


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _values(schedule, steps):
    return [float(schedule(step)) for step in steps]


# --------------------------------------------------------------------------
# Pinned values (hand computed)
# --------------------------------------------------------------------------


def test_linear_scaling():
    assert schedules.linear_scaling(0.1, 65536) == pytest.approx(25.6)
    assert schedules.linear_scaling(0.1, 8192, base_batch_size=256) == \
        pytest.approx(3.2)
    assert schedules.linear_scaling(0.2, 128, base_batch_size=512) == \
        pytest.approx(0.05)
    assert isinstance(schedules.linear_scaling(0.1, 256), float)


def test_epochs_to_steps():
    assert schedules.epochs_to_steps(5, 1251) == 6255
    assert schedules.epochs_to_steps(2.5, 100) == 250
    assert schedules.epochs_to_steps(0, 100) == 0


def test_polynomial_decay_values():
    schedule = schedules.PolynomialDecay(1.0, decay_steps=10)
    # (1 - t)^2: t = 0, 0.5, 1; constant after the end.
    np.testing.assert_allclose(
        _values(schedule, [0, 5, 10, 20]), [1.0, 0.25, 0.0, 0.0], atol=1e-7)
    linear = schedules.PolynomialDecay(1.0, 10, end_learning_rate=0.1,
                                       power=1.0)
    # 0.9 * (1 - 0.5) + 0.1
    np.testing.assert_allclose(_values(linear, [0, 5, 10]), [1.0, 0.55, 0.1],
                               rtol=1e-6)


def test_warmup_to_constant():
    schedule = schedules.Warmup(2.0, warmup_steps=4)
    np.testing.assert_allclose(
        _values(schedule, [0, 1, 2, 4, 10]), [0.0, 0.5, 1.0, 2.0, 2.0],
        rtol=1e-6)


def test_warmup_to_schedule_uses_unshifted_step():
    after = schedules.PolynomialDecay(1.0, decay_steps=100)
    schedule = schedules.Warmup(after, warmup_steps=20,
                                initial_learning_rate=0.1)
    # target = after(20) = (1 - 0.2)^2 = 0.64
    # step 10: 0.1 + (0.64 - 0.1) * 10 / 20 = 0.37
    # step 50: after(50) = 0.5^2 = 0.25
    np.testing.assert_allclose(
        _values(schedule, [0, 10, 20, 50, 100]),
        [0.1, 0.37, 0.64, 0.25, 0.0], rtol=1e-6, atol=1e-7)


def test_warmup_with_keras_schedule_and_no_warmup():
    after = keras.optimizers.schedules.PiecewiseConstantDecay([10], [1.0, 0.1])
    schedule = schedules.Warmup(after, warmup_steps=5)
    np.testing.assert_allclose(_values(schedule, [0, 1, 5, 10, 11]),
                               [0.0, 0.2, 1.0, 1.0, 0.1], rtol=1e-6)
    none = schedules.Warmup(0.3, warmup_steps=0)
    np.testing.assert_allclose(_values(none, [0, 7]), [0.3, 0.3], rtol=1e-6)


def test_warmup_polynomial_decay_values():
    # Peak 10 after 10 warmup steps, total 110 steps, power 2.
    schedule = schedules.WarmupPolynomialDecay(
        initial_learning_rate=10.0, decay_steps=110, warmup_steps=10)
    steps = [0, 5, 10, 60, 85, 110, 200]
    # mid-decay: t = 50/100 -> 10 * 0.25; t = 75/100 -> 10 * 0.0625
    expected = [0.0, 5.0, 10.0, 2.5, 0.625, 0.0, 0.0]
    np.testing.assert_allclose(_values(schedule, steps), expected,
                               rtol=1e-6, atol=1e-6)

    shifted = schedules.WarmupPolynomialDecay(
        initial_learning_rate=10.0, decay_steps=110, warmup_steps=10,
        end_learning_rate=1.0, power=1.0, warmup_initial_learning_rate=2.0)
    # warmup: 2 + 8 * 5 / 10 = 6; decay: 9 * (1 - 0.5) + 1 = 5.5
    np.testing.assert_allclose(
        _values(shifted, [0, 5, 10, 60, 110]), [2.0, 6.0, 10.0, 5.5, 1.0],
        rtol=1e-6)

    no_warmup = schedules.WarmupPolynomialDecay(4.0, 10, 0)
    np.testing.assert_allclose(_values(no_warmup, [0, 5, 10]),
                               [4.0, 1.0, 0.0], atol=1e-6)


def test_one_cycle_values():
    # initial = 1 / 25 = 0.04, minimum = 0.04 / 1e4 = 4e-6,
    # peak step p = 0.2 * 50 - 1 = 9, last step T = 49.
    schedule = schedules.OneCycle(1.0, total_steps=50, pct_start=0.2)
    minimum = 4e-6
    expected = {
        0: 0.04,
        # pct = 3/9: 1 + (0.04 - 1) / 2 * (1 + cos(pi/3)) = 1 - 0.48 * 1.5
        3: 0.28,
        9: 1.0,
        # pct = 10/40: minimum + (1 - minimum) / 2 * (1 + cos(pi/4))
        19: minimum + (1 - minimum) / 2 * (1 + math.sqrt(0.5)),
        # pct = 20/40 = 0.5: the midpoint
        29: (1 + minimum) / 2,
        49: minimum,
        70: minimum,
    }
    np.testing.assert_allclose(_values(schedule, list(expected)),
                               list(expected.values()), rtol=1e-5, atol=1e-9)


def test_slow_start_values_are_akiba_et_al_epochs_and_multipliers():
    # ResNet-50 at 32K: eta = 0.1 * 32768 / 256 = 12.8; 90 epochs of 10 steps.
    # 0.5 eta to epoch 40, 0.075 eta to 70, 0.01 eta to 85, 0.001 eta to 90.
    schedule = schedules.SlowStart(12.8, total_steps=900)
    assert schedule.boundaries() == [400, 700, 850]
    steps = [0, 399, 400, 699, 700, 849, 850, 899, 5000]
    np.testing.assert_allclose(
        _values(schedule, steps),
        [6.4, 6.4, 0.96, 0.96, 0.128, 0.128, 0.0128, 0.0128, 0.0128],
        rtol=1e-6)
    # The same fractions of a shorter run: 9 "epochs" of 10 steps.
    assert schedules.SlowStart(1.0, 90).boundaries() == [40, 70, 85]
    custom = schedules.SlowStart(2.0, 10, boundary_fractions=[0.5],
                                 multipliers=[1.0, 0.1])
    np.testing.assert_allclose(_values(custom, [0, 4, 5, 9]),
                               [2.0, 2.0, 0.2, 0.2], rtol=1e-6)


@pytest.mark.parametrize(
    "schedule",
    [
        schedules.SlowStart(12.8, 100),
        schedules.PolynomialDecay(1.0, 100),
        schedules.Warmup(schedules.PolynomialDecay(1.0, 100), 10),
        schedules.WarmupPolynomialDecay(3.0, 100, 10),
        schedules.OneCycle(2.0, 100),
    ],
    ids=lambda s: type(s).__name__,
)
@tensorflow_only
def test_works_in_tf_function_with_int64_step(schedule):
    import tensorflow as tf

    @tf.function
    def at(step):
        return schedule(step)

    for step in (0, 7, 55, 200):
        value = at(tf.constant(step, tf.int64))
        assert value.dtype == tf.float32
        assert float(value) == pytest.approx(float(schedule(step)), rel=1e-6)


def test_drives_an_optimizer():
    schedule = schedules.WarmupPolynomialDecay(1.0, decay_steps=10,
                                               warmup_steps=2)
    optimizer = keras.optimizers.SGD(learning_rate=schedule)
    var = keras.Variable(np.zeros(3, np.float32))
    seen = []
    for _ in range(4):
        seen.append(float(optimizer.learning_rate))
        optimizer.apply([keras.ops.ones(3)], [var])
    # steps 0..3: 0, 0.5, 1, (1 - 1/8)^2
    np.testing.assert_allclose(seen, [0.0, 0.5, 1.0, 0.765625], rtol=1e-6)
    np.testing.assert_allclose(var.numpy(), -sum(seen[:3]) - 0.765625,
                               rtol=1e-6)


# --------------------------------------------------------------------------
# Serialization
# --------------------------------------------------------------------------

_SCHEDULES = [
    (schedules.PolynomialDecay,
     dict(initial_learning_rate=2.0, decay_steps=50, end_learning_rate=0.01,
          power=1.5)),
    (schedules.Warmup,
     dict(after_warmup=0.5, warmup_steps=7, initial_learning_rate=0.05)),
    (schedules.WarmupPolynomialDecay,
     dict(initial_learning_rate=29.0, decay_steps=1000, warmup_steps=100,
          end_learning_rate=0.0001, power=2.0,
          warmup_initial_learning_rate=0.5)),
    (schedules.OneCycle,
     dict(max_learning_rate=3.0, total_steps=400, pct_start=0.25,
          div_factor=10.0, final_div_factor=100.0)),
    (schedules.SlowStart,
     dict(initial_learning_rate=12.8, total_steps=900,
          boundary_fractions=[0.25, 0.5], multipliers=[1.0, 0.1, 0.01])),
]


@pytest.mark.parametrize("cls, kwargs", _SCHEDULES,
                         ids=[c.__name__ for c, _ in _SCHEDULES])
def test_serialization_round_trip(cls, kwargs):
    schedule = cls(**kwargs)
    assert schedule.get_config() == kwargs
    assert cls.from_config(schedule.get_config()).get_config() == kwargs
    serialized = keras.optimizers.schedules.serialize(schedule)
    restored = keras.optimizers.schedules.deserialize(
        json.loads(json.dumps(serialized)))
    assert type(restored) is cls
    assert restored.get_config() == kwargs
    steps = [0, 3, 50, 120, 999]
    assert _values(restored, steps) == _values(schedule, steps)


def test_nested_warmup_serialization_round_trip():
    inner = schedules.OneCycle(1.0, 100)
    schedule = schedules.Warmup(inner, warmup_steps=5)
    config = schedule.get_config()
    assert config["after_warmup"] == keras.optimizers.schedules.serialize(inner)
    restored = keras.optimizers.schedules.deserialize(
        json.loads(json.dumps(keras.optimizers.schedules.serialize(schedule))))
    assert isinstance(restored.after_warmup, schedules.OneCycle)
    assert restored.get_config() == config
    # Inside an optimizer's config, too.
    optimizer = keras.optimizers.SGD(learning_rate=schedule)
    clone = keras.optimizers.deserialize(
        json.loads(json.dumps(keras.optimizers.serialize(optimizer))))
    assert clone.get_config() == optimizer.get_config()


# --------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: schedules.linear_scaling(-0.1, 256),
         "`base_lr` must be a number > 0. Received: base_lr=-0.1"),
        (lambda: schedules.linear_scaling(0.1, 0),
         "`global_batch_size` must be an integer >= 1. "
         "Received: global_batch_size=0"),
        (lambda: schedules.linear_scaling(0.1, 256, base_batch_size=2.5),
         "`base_batch_size` must be an integer >= 1. "
         "Received: base_batch_size=2.5"),
        (lambda: schedules.epochs_to_steps(-1, 10),
         "`epochs` must be a number >= 0. Received: epochs=-1"),
        (lambda: schedules.PolynomialDecay(1.0, 0),
         "`decay_steps` must be an integer >= 1. Received: decay_steps=0"),
        (lambda: schedules.PolynomialDecay(1.0, 10, power=0),
         "`power` must be a number > 0. Received: power=0"),
        (lambda: schedules.Warmup("0.1", 10),
         "`after_warmup` must be a LearningRateSchedule or a number >= 0. "
         "Received: after_warmup='0.1'"),
        (lambda: schedules.Warmup(0.1, -1),
         "`warmup_steps` must be an integer >= 0. Received: warmup_steps=-1"),
        (lambda: schedules.WarmupPolynomialDecay(0.0, 100, 10),
         "`initial_learning_rate` must be a number > 0. "
         "Received: initial_learning_rate=0.0"),
        (lambda: schedules.WarmupPolynomialDecay(1.0, 10, 10),
         "`decay_steps` (the total number of steps) must be an integer "
         "greater than `warmup_steps` (10). Received: decay_steps=10"),
        (lambda: schedules.WarmupPolynomialDecay(1.0, 100, 10,
                                                 end_learning_rate=-1.0),
         "`end_learning_rate` must be a number >= 0. "
         "Received: end_learning_rate=-1.0"),
        (lambda: schedules.OneCycle(1.0, 100, pct_start=1.0),
         "`pct_start` must be a number in the open interval (0, 1). "
         "Received: pct_start=1.0"),
        (lambda: schedules.OneCycle(1.0, 4, pct_start=0.25),
         "`pct_start * total_steps` must be > 1 so that the warmup phase "
         "spans at least one step. Received: pct_start=0.25, total_steps=4"),
        (lambda: schedules.OneCycle(1.0, 100, div_factor=0),
         "`div_factor` must be a number > 0. Received: div_factor=0"),
        (lambda: schedules.OneCycle(-1.0, 100),
         "`max_learning_rate` must be a number > 0. "
         "Received: max_learning_rate=-1.0"),
        (lambda: schedules.SlowStart(0.0, 100),
         "`initial_learning_rate` must be a number > 0. "
         "Received: initial_learning_rate=0.0"),
        (lambda: schedules.SlowStart(1.0, 0),
         "`total_steps` must be an integer >= 1. Received: total_steps=0"),
        (lambda: schedules.SlowStart(1.0, 90, boundary_fractions=[0.5, 0.4],
                                     multipliers=[1.0, 0.1, 0.01]),
         "`boundary_fractions` must be a list of increasing numbers in (0, 1)."
         " Received: boundary_fractions=[0.5, 0.4]"),
        (lambda: schedules.SlowStart(1.0, 90, boundary_fractions=[0.5],
                                     multipliers=[1.0]),
         "`multipliers` must be a list of numbers > 0, one more than "
         "`boundary_fractions` (2). Received: multipliers=[1.0]"),
    ],
)
def test_argument_errors(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_per_accumulated_step_counts_updates_and_round_trips():
    inner = schedules.WarmupPolynomialDecay(
        initial_learning_rate=1.0, decay_steps=10, warmup_steps=2)
    schedule = schedules.PerAccumulatedStep(inner, accumulation_steps=4)
    # Micro-batch steps 4j..4j+3 belong to update j.
    for step in range(40):
        assert float(schedule(step)) == float(inner(step // 4)), step
    restored = keras.optimizers.schedules.deserialize(
        json.loads(json.dumps(keras.optimizers.schedules.serialize(schedule))))
    assert type(restored) is schedules.PerAccumulatedStep
    assert restored.get_config() == schedule.get_config()
    assert float(restored(13)) == float(inner(3))
    with pytest.raises(ValueError, match=(
            r"`accumulation_steps` must be an integer >= 1. "
            r"Received: accumulation_steps=0")):
        schedules.PerAccumulatedStep(inner, 0)
    with pytest.raises(ValueError, match=r"`schedule` must be a LearningRateSchedule"):
        schedules.PerAccumulatedStep(0.1, 2)
