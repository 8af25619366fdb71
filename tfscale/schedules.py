"""Learning-rate rules and schedules for large-batch training.

The recipe of Jia et al. 2018 (and of the MLPerf ResNet-50 LARS reference):
scale the learning rate with the global batch (`linear_scaling`), ramp it up
linearly over the first epochs (`Warmup`), then decay it polynomially with
power 2 to the end of training (`PolynomialDecay`, or both at once:
`WarmupPolynomialDecay`). `OneCycle` is the super-convergence alternative;
`SlowStart` is the step schedule of Akiba et al. 2017 (ResNet-50 at 32K).

All schedules are `keras.optimizers.schedules.LearningRateSchedule`s: they
take the optimizer's step (a Python number or an integer tensor, also inside
`tf.function`) and return a float32 scalar tensor. Schedules count steps
(optimizer updates); convert epochs with `epochs_to_steps`
(`steps = round(epochs * steps_per_epoch)`).
"""

import math

import keras
from keras import ops

from tfscale._validation import is_int
from tfscale._validation import is_finite_number
from tfscale._validation import is_number

LearningRateSchedule = keras.optimizers.schedules.LearningRateSchedule


def _check_float(name, value, rule, ok):
    """Raises ValueError unless `value` is a real number with `ok(value)`."""
    if not (is_finite_number(value) and ok(value)):
        raise ValueError(f"`{name}` must be {rule}. Received: {name}={value!r}")
    return float(value)


def _check_positive(name, value):
    """Raises ValueError unless `value` is a finite number > 0."""
    return _check_float(name, value, "a number > 0", lambda v: v > 0)


def _check_int(name, value, low):
    """Raises ValueError unless `value` is an integer >= `low`."""
    if not (is_int(value) and value >= low):
        raise ValueError(
            f"`{name}` must be an integer >= {low}. Received: {name}={value!r}"
        )
    return int(value)


def _step_float(step):
    return ops.cast(step, "float32")


def linear_scaling(base_lr, global_batch_size, base_batch_size=256):
    """Linear scaling rule: the learning rate grows with the batch size.

    ```python
    lr = base_lr * global_batch_size / base_batch_size
    ```

    E.g. ResNet-50's 0.1 at batch 256 gives 25.6 at batch 65536 (with LARS
    the peak is usually tuned below this; the rule gives the starting point).

    Args:
        base_lr: float > 0, the learning rate tuned at `base_batch_size`.
        global_batch_size: int >= 1, the batch of one optimizer step summed
            over all workers.
        base_batch_size: int >= 1, the reference batch. Defaults to `256`.

    Returns:
        The scaled learning rate, a Python float.

    References:
        - [Goyal et al., 2017. Accurate, Large Minibatch SGD: Training
          ImageNet in 1 Hour](https://arxiv.org/abs/1706.02677)
    """
    base_lr = _check_positive("base_lr", base_lr)
    global_batch_size = _check_int("global_batch_size", global_batch_size, 1)
    base_batch_size = _check_int("base_batch_size", base_batch_size, 1)
    return base_lr * global_batch_size / base_batch_size


def epochs_to_steps(epochs, steps_per_epoch):
    """Converts a duration in epochs to optimizer steps.

    ```python
    steps = round(epochs * steps_per_epoch)
    ```

    Args:
        epochs: number >= 0, may be fractional (e.g. warmup over 2.5 epochs).
        steps_per_epoch: int >= 1, i.e. `ceil(num_examples / global_batch)`
            (or the `steps_per_epoch` given to `model.fit`).

    Returns:
        An int.
    """
    epochs = _check_float("epochs", epochs, "a number >= 0", lambda v: v >= 0)
    steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch, 1)
    return int(round(epochs * steps_per_epoch))


@keras.saving.register_keras_serializable(package="tfscale")
class PolynomialDecay(LearningRateSchedule):
    """Polynomial decay from `initial_learning_rate` to `end_learning_rate`.

    ```python
    t = min(step, decay_steps) / decay_steps
    lr = (initial_learning_rate - end_learning_rate) * (1 - t) ** power
         + end_learning_rate
    ```

    After `decay_steps` the learning rate stays at `end_learning_rate`.
    Unlike `keras.optimizers.schedules.PolynomialDecay` the defaults are the
    MLPerf LARS ones (`end_learning_rate=0.0`, `power=2.0`) and the result is
    always float32.

    Args:
        initial_learning_rate: float >= 0, the learning rate at step 0.
        decay_steps: int >= 1, the number of steps to decay over.
        end_learning_rate: float >= 0, the final learning rate. Defaults to
            `0.0`.
        power: float > 0, the polynomial's power. Defaults to `2.0`.
    """

    def __init__(
        self,
        initial_learning_rate,
        decay_steps,
        end_learning_rate=0.0,
        power=2.0,
    ):
        super().__init__()
        self.initial_learning_rate = _check_float(
            "initial_learning_rate", initial_learning_rate, "a number >= 0",
            lambda v: v >= 0,
        )
        self.decay_steps = _check_int("decay_steps", decay_steps, 1)
        self.end_learning_rate = _check_float(
            "end_learning_rate", end_learning_rate, "a number >= 0",
            lambda v: v >= 0,
        )
        self.power = _check_positive("power", power)

    def __call__(self, step):
        step = ops.clip(_step_float(step), 0.0, float(self.decay_steps))
        remaining = ops.subtract(1.0, ops.divide(step, float(self.decay_steps)))
        decayed = ops.multiply(
            self.initial_learning_rate - self.end_learning_rate,
            ops.power(remaining, self.power),
        )
        return ops.cast(ops.add(decayed, self.end_learning_rate), "float32")

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
        }


@keras.saving.register_keras_serializable(package="tfscale")
class Warmup(LearningRateSchedule):
    """Linear warmup in front of another schedule (gradual warmup).

    ```python
    target = after_warmup(warmup_steps)  # or the float `after_warmup`
    if step < warmup_steps:
        lr = initial_learning_rate
             + (target - initial_learning_rate) * step / warmup_steps
    else:
        lr = after_warmup(step)
    ```

    `after_warmup` sees the unshifted step: its own step 0 is the start of
    training, so a decay it describes already runs during the warmup (as in
    tf-models-official's `LinearWarmup`). Use `WarmupPolynomialDecay` for a
    decay that starts when the warmup ends. With the default
    `initial_learning_rate=0.0` the first step has learning rate 0. Warmup
    over epochs: `warmup_steps = epochs_to_steps(epochs, steps_per_epoch)`.

    Args:
        after_warmup: a `LearningRateSchedule` or a float >= 0: the learning
            rate after the warmup.
        warmup_steps: int >= 0, the length of the ramp in steps (0: no
            warmup).
        initial_learning_rate: float >= 0, the learning rate at step 0.
            Defaults to `0.0`.

    References:
        - [Goyal et al., 2017. Accurate, Large Minibatch SGD: Training
          ImageNet in 1 Hour](https://arxiv.org/abs/1706.02677)
    """

    def __init__(self, after_warmup, warmup_steps, initial_learning_rate=0.0):
        super().__init__()
        if isinstance(after_warmup, LearningRateSchedule):
            self.after_warmup = after_warmup
        else:
            self.after_warmup = _check_float(
                "after_warmup", after_warmup,
                "a LearningRateSchedule or a number >= 0", lambda v: v >= 0,
            )
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.initial_learning_rate = _check_float(
            "initial_learning_rate", initial_learning_rate, "a number >= 0",
            lambda v: v >= 0,
        )

    def _after(self, step):
        if isinstance(self.after_warmup, LearningRateSchedule):
            return ops.cast(self.after_warmup(step), "float32")
        return ops.convert_to_tensor(self.after_warmup, "float32")

    def __call__(self, step):
        # `after_warmup` gets the step as given (it may compare it with
        # integer boundaries, e.g. PiecewiseConstantDecay).
        after = self._after(step)
        if self.warmup_steps == 0:
            return after
        target = self._after(self.warmup_steps)
        step = _step_float(step)
        fraction = ops.divide(step, float(self.warmup_steps))
        ramp = ops.add(
            self.initial_learning_rate,
            ops.multiply(ops.subtract(target, self.initial_learning_rate),
                         fraction),
        )
        return ops.where(ops.less(step, float(self.warmup_steps)), ramp, after)

    def get_config(self):
        after_warmup = self.after_warmup
        if isinstance(after_warmup, LearningRateSchedule):
            after_warmup = keras.optimizers.schedules.serialize(after_warmup)
        return {
            "after_warmup": after_warmup,
            "warmup_steps": self.warmup_steps,
            "initial_learning_rate": self.initial_learning_rate,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config["after_warmup"], dict):
            config["after_warmup"] = keras.optimizers.schedules.deserialize(
                config["after_warmup"]
            )
        return cls(**config)


@keras.saving.register_keras_serializable(package="tfscale")
class WarmupPolynomialDecay(LearningRateSchedule):
    """Linear warmup to a peak, then polynomial decay to the end of training.

    The MLPerf ResNet-50 LARS schedule (power 2). With `w = warmup_steps`,
    `T = decay_steps` (the total number of training steps),
    `lr0 = warmup_initial_learning_rate` and `peak = initial_learning_rate`:

    ```python
    if step < w:
        lr = lr0 + (peak - lr0) * step / w
    else:
        t = min(step - w, T - w) / (T - w)
        lr = (peak - end_learning_rate) * (1 - t) ** power + end_learning_rate
    ```

    So `lr = peak` at step `w` and `lr = end_learning_rate` from step `T`
    on. (The MLPerf reference divides by `T - w + 1`, so it stops one step
    short of `end_learning_rate`; the difference is below `2 / (T - w)` of
    the peak.) Epochs: `warmup_steps = epochs_to_steps(warmup_epochs,
    steps_per_epoch)`, `decay_steps = epochs_to_steps(epochs,
    steps_per_epoch)`.

    Args:
        initial_learning_rate: float > 0, the peak learning rate, reached at
            the end of the warmup (e.g. from `linear_scaling`).
        decay_steps: int, the total number of training steps; must be
            greater than `warmup_steps`.
        warmup_steps: int >= 0, the length of the linear warmup.
        end_learning_rate: float >= 0, the learning rate at `decay_steps`.
            Defaults to `0.0`.
        power: float > 0, the power of the decay. Defaults to `2.0`.
        warmup_initial_learning_rate: float >= 0, the learning rate at step
            0. Defaults to `0.0`.

    References:
        - [Goyal et al., 2017](https://arxiv.org/abs/1706.02677) (warmup)
        - [Jia et al., 2018](https://arxiv.org/abs/1807.11205)
        - MLPerf Training, ResNet-50 LARS reference (`lars_util.py`).
    """

    def __init__(
        self,
        initial_learning_rate,
        decay_steps,
        warmup_steps,
        end_learning_rate=0.0,
        power=2.0,
        warmup_initial_learning_rate=0.0,
    ):
        super().__init__()
        self.initial_learning_rate = _check_positive(
            "initial_learning_rate", initial_learning_rate)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        if not (is_int(decay_steps) and decay_steps > self.warmup_steps):
            raise ValueError(
                "`decay_steps` (the total number of steps) must be an integer "
                f"greater than `warmup_steps` ({self.warmup_steps}). "
                f"Received: decay_steps={decay_steps!r}"
            )
        self.decay_steps = int(decay_steps)
        self.end_learning_rate = _check_float(
            "end_learning_rate", end_learning_rate, "a number >= 0",
            lambda v: v >= 0,
        )
        self.power = _check_positive("power", power)
        self.warmup_initial_learning_rate = _check_float(
            "warmup_initial_learning_rate", warmup_initial_learning_rate,
            "a number >= 0", lambda v: v >= 0,
        )
        decay = PolynomialDecay(
            self.initial_learning_rate,
            self.decay_steps - self.warmup_steps,
            self.end_learning_rate,
            self.power,
        )
        self._decay = decay

    def __call__(self, step):
        step = _step_float(step)
        decayed = self._decay(
            ops.maximum(ops.subtract(step, float(self.warmup_steps)), 0.0)
        )
        if self.warmup_steps == 0:
            return decayed
        lr0 = self.warmup_initial_learning_rate
        ramp = ops.add(
            lr0,
            ops.multiply(
                self.initial_learning_rate - lr0,
                ops.divide(step, float(self.warmup_steps)),
            ),
        )
        return ops.cast(
            ops.where(ops.less(step, float(self.warmup_steps)), ramp, decayed),
            "float32",
        )

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "warmup_steps": self.warmup_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "warmup_initial_learning_rate": self.warmup_initial_learning_rate,
        }


@keras.saving.register_keras_serializable(package="tfscale")
class OneCycle(LearningRateSchedule):
    """One-cycle policy: cosine warmup to a maximum, cosine annealing after.

    Two cosine phases, as PyTorch's `OneCycleLR` (`anneal_strategy="cos"`,
    `three_phase=False`, its defaults) and fastai's `fit_one_cycle`. With
    `initial = max_learning_rate / div_factor`,
    `minimum = initial / final_div_factor`, `p = pct_start * total_steps - 1`
    and `T = total_steps - 1`:

    ```python
    def cos_anneal(start, end, pct):
        return end + (start - end) / 2 * (1 + cos(pi * pct))
    step = min(step, T)
    if step <= p:
        lr = cos_anneal(initial, max_learning_rate, step / p)
    else:
        lr = cos_anneal(max_learning_rate, minimum, (step - p) / (T - p))
    ```

    So `lr = initial` at step 0, `max_learning_rate` at step `p` and
    `minimum` at step `T = total_steps - 1` and after (PyTorch raises past
    `total_steps`; this schedule stays at `minimum`).

    Args:
        max_learning_rate: float > 0, the peak learning rate.
        total_steps: int, the number of training steps.
        pct_start: float in (0, 1), the fraction of the steps spent
            increasing the learning rate; `pct_start * total_steps` must be
            greater than 1. Defaults to `0.3`.
        div_factor: float > 0, `initial = max_learning_rate / div_factor`.
            Defaults to `25.0`.
        final_div_factor: float > 0, `minimum = initial / final_div_factor`.
            Defaults to `1e4`.

    References:
        - [Smith & Topin, 2017. Super-Convergence: Very Fast Training of
          Neural Networks Using Large Learning Rates](
          https://arxiv.org/abs/1708.07120)
    """

    def __init__(
        self,
        max_learning_rate,
        total_steps,
        pct_start=0.3,
        div_factor=25.0,
        final_div_factor=1e4,
    ):
        super().__init__()
        self.max_learning_rate = _check_positive(
            "max_learning_rate", max_learning_rate)
        self.total_steps = _check_int("total_steps", total_steps, 2)
        self.pct_start = _check_float(
            "pct_start", pct_start, "a number in the open interval (0, 1)",
            lambda v: 0 < v < 1,
        )
        if self.pct_start * self.total_steps <= 1:
            raise ValueError(
                "`pct_start * total_steps` must be > 1 so that the warmup "
                "phase spans at least one step. Received: "
                f"pct_start={pct_start!r}, total_steps={total_steps!r}"
            )
        self.div_factor = _check_positive("div_factor", div_factor)
        self.final_div_factor = _check_positive("final_div_factor", final_div_factor)

    @staticmethod
    def _cos_anneal(start, end, pct):
        cos_out = ops.add(ops.cos(ops.multiply(math.pi, pct)), 1.0)
        return ops.add(end, ops.multiply((start - end) / 2.0, cos_out))

    def __call__(self, step):
        initial = self.max_learning_rate / self.div_factor
        minimum = initial / self.final_div_factor
        peak_step = self.pct_start * self.total_steps - 1.0
        last_step = float(self.total_steps - 1)
        step = ops.clip(_step_float(step), 0.0, last_step)
        up = self._cos_anneal(
            initial, self.max_learning_rate, ops.divide(step, peak_step)
        )
        down = self._cos_anneal(
            self.max_learning_rate,
            minimum,
            ops.divide(ops.subtract(step, peak_step), last_step - peak_step),
        )
        return ops.cast(ops.where(ops.less_equal(step, peak_step), up, down),
                        "float32")

    def get_config(self):
        return {
            "max_learning_rate": self.max_learning_rate,
            "total_steps": self.total_steps,
            "pct_start": self.pct_start,
            "div_factor": self.div_factor,
            "final_div_factor": self.final_div_factor,
        }


@keras.saving.register_keras_serializable(package="tfscale")
class PerAccumulatedStep(LearningRateSchedule):
    """A schedule of optimizer updates, for an optimizer that accumulates.

    With `gradient_accumulation_steps=k` Keras evaluates the learning-rate
    schedule at every micro-batch's step (its `iterations` counts updates,
    but the schedule gets the micro-batch count). This wrapper gives
    `schedule` the number of updates instead, so k micro-batches of b train
    as one step of k*b does, warmup and decay included:

    ```python
    lr = schedule(step // accumulation_steps)
    ```

    Args:
        schedule: a `LearningRateSchedule` over optimizer updates.
        accumulation_steps: int >= 1, the optimizer's
            `gradient_accumulation_steps` (1: `schedule` unchanged).
    """

    def __init__(self, schedule, accumulation_steps):
        super().__init__()
        if not isinstance(schedule, LearningRateSchedule):
            raise ValueError(
                "`schedule` must be a LearningRateSchedule. "
                f"Received: schedule={schedule!r}")
        self.schedule = schedule
        self.accumulation_steps = _check_int(
            "accumulation_steps", accumulation_steps, 1)

    def __call__(self, step):
        return self.schedule(ops.floor_divide(step, self.accumulation_steps))

    def get_config(self):
        return {
            "schedule": keras.optimizers.schedules.serialize(self.schedule),
            "accumulation_steps": self.accumulation_steps,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.optimizers.schedules.deserialize(
            config["schedule"])
        return cls(**config)


# Akiba et al. 2017's ResNet-50 schedule over 90 epochs (see `SlowStart`).
SLOW_START_BOUNDARY_EPOCHS = (40, 70, 85)
SLOW_START_MULTIPLIERS = (0.5, 0.075, 0.01, 0.001)
SLOW_START_EPOCHS = 90


@keras.saving.register_keras_serializable(package="tfscale")
class SlowStart(LearningRateSchedule):
    """Slow-start step schedule: a low, long first phase, then step decay.

    Goyal et al. train ResNet-50 for 90 epochs at the scaled learning rate
    `eta = 0.1 * batch / 256`, divided by 10 at epochs 30, 60 and 80. The
    slow-start schedule of Akiba, Suzuki and Fukuda (2017), as reconstructed
    here (see "Source"), starts lower and stays there longer: `0.5 * eta` up to epoch 40, then `0.075 * eta` up to
    70, `0.01 * eta` up to 85 and `0.001 * eta` to the end (90). This class
    places the boundaries at the same fractions of any length of training:

    ```python
    boundaries = [round(f * total_steps) for f in boundary_fractions]
    i = number of boundaries b with step >= b
    lr = initial_learning_rate * multipliers[i]
    ```

    With the defaults (`boundary_fractions = (40/90, 70/90, 85/90)`) and
    `total_steps = 90 * steps_per_epoch` the boundaries fall at epochs 40,
    70 and 85.

    Source: the paper's text (arXiv 1711.04325) was not available to this
    implementation, only its abstract (which names a "slow-start learning
    rate schedule" and 90 epochs at batch 32K); no section of it is cited.
    The epochs and multipliers above are those of a public Chainer
    reproduction's `RMSpropWarmupScheduler` (`lr_base = 0.1 * n_processes
    * batchsize / 256`; `0.5 * lr_base` before epoch 40, `0.075` before 70,
    `0.01` before 85, `0.001` after).

    Args:
        initial_learning_rate: float > 0, `eta`, the learning rate the
            multipliers scale (e.g. `linear_scaling(0.1, batch)`).
        total_steps: int >= 1, the number of training steps.
        boundary_fractions: increasing numbers in (0, 1), the fractions of
            training at which the multiplier changes. Defaults to
            `(40/90, 70/90, 85/90)`.
        multipliers: one more number > 0 than `boundary_fractions`.
            Defaults to `(0.5, 0.075, 0.01, 0.001)`.

    References:
        - [Akiba, Suzuki and Fukuda, 2017. Extremely Large Minibatch SGD:
          Training ResNet-50 on ImageNet in 15 Minutes](
          https://arxiv.org/abs/1711.04325) (abstract).
        - [Goyal et al., 2017](https://arxiv.org/abs/1706.02677) (the
          schedule it slows down).
    """

    def __init__(
        self,
        initial_learning_rate,
        total_steps,
        boundary_fractions=tuple(
            e / SLOW_START_EPOCHS for e in SLOW_START_BOUNDARY_EPOCHS),
        multipliers=SLOW_START_MULTIPLIERS,
    ):
        super().__init__()
        self.initial_learning_rate = _check_positive(
            "initial_learning_rate", initial_learning_rate)
        self.total_steps = _check_int("total_steps", total_steps, 1)
        fractions = list(boundary_fractions) if isinstance(
            boundary_fractions, (list, tuple)) else None
        if (fractions is None or not all(
                is_number(f) and 0 < f < 1 for f in fractions)
                or any(a >= b for a, b in zip(fractions, fractions[1:]))):
            raise ValueError(
                "`boundary_fractions` must be a list of increasing numbers in "
                "(0, 1). Received: "
                f"boundary_fractions={boundary_fractions!r}")
        values = list(multipliers) if isinstance(
            multipliers, (list, tuple)) else None
        if (values is None or len(values) != len(fractions) + 1
                or not all(is_number(v) and v > 0 for v in values)):
            raise ValueError(
                "`multipliers` must be a list of numbers > 0, one more than "
                f"`boundary_fractions` ({len(fractions) + 1}). Received: "
                f"multipliers={multipliers!r}")
        self.boundary_fractions = tuple(float(f) for f in fractions)
        self.multipliers = tuple(float(v) for v in values)

    def boundaries(self):
        """The steps at which the multiplier changes."""
        return [int(round(f * self.total_steps))
                for f in self.boundary_fractions]

    def __call__(self, step):
        step = _step_float(step)
        lr = ops.convert_to_tensor(
            self.initial_learning_rate * self.multipliers[0], "float32")
        for boundary, multiplier in zip(self.boundaries(),
                                        self.multipliers[1:]):
            lr = ops.where(ops.greater_equal(step, float(boundary)),
                           self.initial_learning_rate * multiplier, lr)
        return ops.cast(lr, "float32")

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "total_steps": self.total_steps,
            "boundary_fractions": list(self.boundary_fractions),
            "multipliers": list(self.multipliers),
        }
