"""Large-batch recipes: the optimizer, learning-rate schedule and precision
policy that `Settings` describe. `Settings`, the published `RECIPES` and the
settings file are defined in `tfscale.recipe_settings` (no TensorFlow) and
are public here as well.

```python
settings = tfscale.recipes.Settings.from_recipe("resnet50_lars_32k",
                                                scale_lr=True)
tfscale.recipes.set_precision(settings)  # before building the model
with strategy.scope():
    model = ...
    optimizer, _ = tfscale.recipes.make_optimizer(
        settings, global_batch_size, steps_per_epoch, epochs)
    model.compile(optimizer=optimizer, ...)
tfscale.recipes.write_settings(model_dir, settings)  # a resume compares
```

Weight decay (`Settings.weight_decay = wd`) has one meaning for both
optimizers: L2 added to the gradient before the update, `g <- g + wd * w`,
for every variable except biases and BatchNorm parameters (tfscale LARS's
default exclusions). With LARS it is `weight_decay_rate` and enters the
trust ratio; with SGD it is LARS with every trust ratio fixed at 1, which is
exactly SGD with momentum on the decayed gradient
(`v = m * v + lr * g; w = w - v`). An L2 term `wd / 2 * ||w||^2` in the loss
would give the same gradient.
"""

import keras

from tfscale import optimizers
from tfscale import schedules
# Public here as well (see the module's docstring).
from tfscale.recipe_settings import LR_SCHEDULES
from tfscale.recipe_settings import OPTIMIZERS
from tfscale.recipe_settings import PRECISIONS
from tfscale.recipe_settings import RECIPES
from tfscale.recipe_settings import SETTINGS_FILE
from tfscale.recipe_settings import Settings
from tfscale.recipe_settings import SettingsChangedError
from tfscale.recipe_settings import batch_phases
from tfscale.recipe_settings import check_settings_unchanged
from tfscale.recipe_settings import describe
from tfscale.recipe_settings import read_settings
from tfscale.recipe_settings import settings_differences
from tfscale.recipe_settings import write_settings


def make_schedule(settings, global_batch_size, steps_per_epoch, epochs):
    """The learning rate (a float or a `LearningRateSchedule`) of `settings`.

    - "constant": the peak learning rate, after a linear warmup from 0 over
      `warmup_epochs` if that is > 0.
    - "warmup_poly": linear warmup from 0 to the peak, then polynomial decay
      to `end_learning_rate` at the last step (MLPerf's LARS schedule).
    - "one_cycle": cosine up to the peak over `warmup_epochs` (0: the first
      30% of training), cosine down after.
    - "slow_start": `schedules.SlowStart` from the peak (Akiba et al. 2017:
      0.5, 0.075, 0.01, 0.001 times it from 0, 40/90, 70/90, 85/90 of
      training), after a linear warmup over `warmup_epochs` if that is > 0.

    With `settings.batch_schedule` the learning rate is that of "constant"
    (the linear scaling rule applies to the first global batch only: the
    learning rate stays as the batch grows), divided by
    `Phase.learning_rate_divisor` from the first update of each phase where
    `max_global_batch_size` turns growth into decay; the warmup counts the
    first phase's steps and must end within it.

    Args:
        settings: a `Settings`.
        global_batch_size: examples per step over all workers (with a
            batch schedule: of the first phase).
        steps_per_epoch: optimizer steps per epoch (of the first phase).
        epochs: the length of training; the schedule ends with it.
    """
    peak = settings.peak_learning_rate(global_batch_size)
    if settings.batch_schedule:
        return _batch_schedule_learning_rate(
            settings, peak, global_batch_size, steps_per_epoch, epochs)
    total_steps = steps_per_epoch * epochs
    warmup_steps = schedules.epochs_to_steps(settings.warmup_epochs,
                                             steps_per_epoch)
    if settings.lr_schedule == "constant":
        if warmup_steps == 0:
            return peak
        return schedules.Warmup(peak, warmup_steps)
    if settings.lr_schedule == "slow_start":
        schedule = schedules.SlowStart(peak, total_steps)
        if warmup_steps == 0:
            return schedule
        return schedules.Warmup(schedule, warmup_steps)
    if settings.lr_schedule == "warmup_poly":
        if warmup_steps >= total_steps:
            raise ValueError(
                "`warmup_epochs` must be shorter than training for "
                "lr_schedule='warmup_poly'. Received: "
                f"warmup_epochs={settings.warmup_epochs!r}, epochs={epochs!r}"
            )
        return schedules.WarmupPolynomialDecay(
            initial_learning_rate=peak,
            decay_steps=total_steps,
            warmup_steps=warmup_steps,
            end_learning_rate=settings.end_learning_rate,
            power=settings.poly_power,
        )
    pct_start = settings.warmup_epochs / epochs if warmup_steps else 0.3
    if not 0 < pct_start < 1:
        raise ValueError(
            "`warmup_epochs` must be shorter than training for "
            f"lr_schedule='one_cycle'. Received: "
            f"warmup_epochs={settings.warmup_epochs!r}, epochs={epochs!r}"
        )
    return schedules.OneCycle(peak, total_steps, pct_start=pct_start)


def _batch_schedule_learning_rate(settings, peak, global_batch_size,
                                  steps_per_epoch, epochs):
    """`make_schedule` under a batch schedule: constant (after a warmup in
    the first phase), divided by each phase's divisor."""
    phases = batch_phases(settings, global_batch_size, steps_per_epoch, epochs)
    if len(phases) > 1 and settings.warmup_epochs > phases[1].first_epoch:
        raise ValueError(
            "`warmup_epochs` must end before the batch schedule's first "
            f"event (epoch {phases[1].first_epoch}). Received: "
            f"warmup_epochs={settings.warmup_epochs!r}, "
            f"batch_schedule={settings.batch_schedule!r}")
    boundaries, values = [], [peak]
    for before, phase in zip(phases, phases[1:]):
        if phase.learning_rate_divisor != before.learning_rate_divisor:
            # PiecewiseConstantDecay switches after `step > boundary`; the
            # phase's first update is step `first_step`.
            boundaries.append(phase.first_step - 1)
            values.append(peak / phase.learning_rate_divisor)
    learning_rate = peak
    if boundaries:
        learning_rate = keras.optimizers.schedules.PiecewiseConstantDecay(
            boundaries, values)
    warmup_steps = schedules.epochs_to_steps(settings.warmup_epochs,
                                             steps_per_epoch)
    if warmup_steps:
        learning_rate = schedules.Warmup(learning_rate, warmup_steps)
    return learning_rate


def make_optimizer(settings, global_batch_size, steps_per_epoch, epochs):
    """The Keras optimizer and its learning rate described by `settings`.

    Under `mixed_float16` the optimizer is wrapped in
    `tfscale.optimizers.LossScaleOptimizer`, whatever the strategy (under
    `tfscale.Strategy`, `compile` would choose the same for a plain
    optimizer; under stock strategies it would wrap it in Keras's own, which
    deadlocks across workers when one overflows). Build it inside
    `strategy.scope()`.

    With `settings.accumulation_steps = k > 1` the optimizer accumulates k
    micro-batches per update (`gradient_accumulation_steps`) and its
    schedule counts updates (`schedules.PerAccumulatedStep`): fit it with
    k * `steps_per_epoch` micro-batches of `global_batch_size / k` per epoch.

    Args:
        settings: a `Settings`.
        global_batch_size: examples per optimizer step over all workers.
        steps_per_epoch: optimizer steps per epoch.
        epochs: the length of training; decaying schedules end with it.

    Returns:
        `(optimizer, learning_rate)`: the optimizer to pass to `compile`,
        and the float or `LearningRateSchedule` it uses.
    """
    learning_rate = make_schedule(
        settings, global_batch_size, steps_per_epoch, epochs)
    accumulation = {}
    if settings.accumulation_steps > 1:
        accumulation["gradient_accumulation_steps"] = settings.accumulation_steps
        if isinstance(learning_rate, schedules.LearningRateSchedule):
            learning_rate = schedules.PerAccumulatedStep(
                learning_rate, settings.accumulation_steps)
    if settings.optimizer == "lars":
        optimizer = optimizers.LARS(
            learning_rate=learning_rate,
            momentum=settings.momentum,
            weight_decay_rate=settings.weight_decay,
            eeta=settings.eeta,
            epsilon=settings.lars_epsilon,
            **accumulation,
        )
    elif settings.optimizer == "rmsprop_warmup":
        optimizer = optimizers.RMSpropWarmup(
            learning_rate=learning_rate,
            rmsprop_learning_rate=settings.rmsprop_learning_rate,
            mu1=settings.momentum,
            beta_center=settings.rmsprop_warmup_center_epochs * steps_per_epoch,
            beta_period=settings.rmsprop_warmup_period_epochs * steps_per_epoch,
            weight_decay_rate=settings.weight_decay,
            **accumulation,
        )
    elif settings.weight_decay:
        # Trust ratio 1 everywhere: SGD with momentum on g + wd * w, with
        # LARS's exclusion of biases and BatchNorm from the decay. It keeps
        # LARS's name: it is a LARS instance.
        optimizer = optimizers.LARS(
            learning_rate=learning_rate,
            momentum=settings.momentum,
            weight_decay_rate=settings.weight_decay,
            exclude_from_layer_adaptation=[".*"],
            **accumulation,
        )
    else:
        optimizer = keras.optimizers.SGD(
            learning_rate=learning_rate, momentum=settings.momentum,
            **accumulation)
    if settings.precision == "mixed_float16":
        optimizer = optimizers.LossScaleOptimizer(optimizer)
    return optimizer, learning_rate


def set_precision(settings):
    """Sets Keras's global dtype policy to `settings.precision`.

    Call it before building the model: layers take the policy when created.
    """
    keras.mixed_precision.set_global_policy(settings.precision)
