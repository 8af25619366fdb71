"""RMSprop warm-up (Akiba et al. 2017): RMSprop first, momentum SGD after."""

import math

import keras
from keras import ops

from tfscale._validation import is_number
from tfscale.optimizers.exclusion import check_number
from tfscale.optimizers.exclusion import check_patterns
from tfscale.optimizers.exclusion import excluded


def sgd_coefficient(step, beta_center, beta_period):
    """The weight of momentum SGD in RMSprop warm-up at `step` (a float).

    The ELU-shaped switch of `RMSpropWarmup`, in Python (for tests and
    plots; the optimizer computes the same in its graph):

    ```python
    x = (step - beta_center) / beta_period
    if x < 0:
        alpha_sgd = 0.5 * exp(2 * x)
    elif x < 0.5:
        alpha_sgd = 0.5 + x
    else:
        alpha_sgd = 1.0
    ```

    Args:
        step: number >= 0, the optimizer step.
        beta_center: the step where SGD and RMSprop weigh half each.
        beta_period: the length of the switch in steps (> 0).
    """
    x = (step - beta_center) / beta_period
    if x < 0:
        return 0.5 * math.exp(2.0 * x)
    return min(0.5 + x, 1.0)


@keras.saving.register_keras_serializable(package="tfscale")
class RMSpropWarmup(keras.optimizers.Optimizer):
    """RMSprop warm-up: starts as RMSprop and turns into momentum SGD.

    Akiba, Suzuki and Fukuda (2017) trained ResNet-50 at batch 32K in 15
    minutes with, among other techniques, "RMSprop warm-up": training starts
    with RMSprop (adaptive per-element steps, robust to the badly scaled
    gradients of the first steps) and moves gradually to momentum SGD. As
    reconstructed here (see "Source"), one update mixes both: for a
    variable `w` with gradient `g`, second-moment slot `m` and velocity slot
    `d`:

    ```python
    g = g + weight_decay_rate * w          # if w gets weight decay
    alpha_sgd = sgd_coefficient(step, beta_center, beta_period)
    alpha_rmsprop = (1 - alpha_sgd) * rmsprop_learning_rate / learning_rate
    m = mu2 * m + (1 - mu2) * g * g
    d = mu1 * d - (alpha_sgd + alpha_rmsprop / (sqrt(m) + epsilon)) * g
    w = w + learning_rate * d
    ```

    At the start (`alpha_sgd` ~ 0) the step is RMSprop's,
    `rmsprop_learning_rate * g / (sqrt(m) + epsilon)` (with momentum
    `mu1`), whatever `learning_rate` is; from `beta_center + beta_period / 2`
    on (`alpha_sgd` = 1) it is exactly momentum SGD with `learning_rate`
    (Keras's `SGD(momentum=mu1)` for a constant learning rate). In between,
    `alpha_sgd` follows an ELU-shaped curve: `0.5 * exp(2 x)` before the
    center, `0.5 + x` after, `x = (step - beta_center) / beta_period`, whose
    value and slope are continuous at the center (`sgd_coefficient`). The
    second moment `m` is updated at every step, so it is current when SGD
    hands back. With `learning_rate = 0` the step is 0.

    Source of the rule: the paper's text (arXiv 1711.04325) was not
    available to this implementation, only its abstract (which names
    "RMSprop warm-up"); no section or equation of it is cited here.
    The update rule, the ELU-shaped switch and the defaults
    (`rmsprop_learning_rate=3e-4`, `mu1=0.9`, `mu2=0.99`, `epsilon=1e-8`,
    a center of 10 epochs and a period of 5 epochs) are reconstructed from
    public Chainer implementations named `RMSpropWarmup` (hyper-parameters
    `lr_sgd`, `lr_rmsprop`, `mu1`, `mu2`, `eps`, `beta_center`,
    `beta_period`). Those disagree on the linear part (`0.5 + x` in one,
    `0.5 + 2 x` up to `x = 0.5`, which passes 1, in others); this class
    takes `0.5 + x`, the one that is continuous in value and slope and
    reaches 1 at the end of its range. They count the switch in epochs
    (updated once per epoch); this class counts optimizer steps, so convert
    with `tfscale.schedules.epochs_to_steps`.

    Precision: computed in at least float32 (gradient and learning rates
    cast to the variable's dtype, float16/bfloat16 variables computed in
    float32), like `tfscale.optimizers.LARS`.

    Args:
        learning_rate: a float, a `LearningRateSchedule` (e.g.
            `tfscale.schedules.SlowStart`) or a callable: SGD's learning
            rate (the paper's eta). Defaults to `0.1`.
        rmsprop_learning_rate: float >= 0, RMSprop's learning rate (eta'),
            constant. Defaults to `3e-4`.
        mu1: float in `[0, 1]`, the momentum of `d`. Defaults to `0.9`.
        mu2: float in `[0, 1)`, the decay of the second moment `m`.
            Defaults to `0.99`.
        epsilon: float > 0 added to `sqrt(m)`. Defaults to `1e-8`.
        beta_center: number >= 0, the step at which `alpha_sgd = 0.5`.
            Defaults to `10.0` (10 epochs of 1 step; set it in steps).
        beta_period: number > 0, steps; `alpha_sgd` reaches 1 at
            `beta_center + beta_period / 2`. Defaults to `5.0`.
        weight_decay_rate: float >= 0, L2 added to the gradient before the
            update (`g + wd * w`), as `tfscale.optimizers.LARS` does.
            Defaults to `0.0`.
        exclude_from_weight_decay: `None` (biases and BatchNorm parameters,
            LARS's built-in rule) or a list of regular expressions searched
            in each variable's path. Defaults to `None`.
        name: Defaults to `"RMSpropWarmup"`.
        **kwargs: arguments of `keras.optimizers.Optimizer` (`clipnorm`,
            `global_clipnorm`, `gradient_accumulation_steps`, ...).

    Example:

    ```python
    steps_per_epoch = 39  # ImageNet at 32K
    optimizer = tfscale.optimizers.RMSpropWarmup(
        learning_rate=tfscale.schedules.SlowStart(12.8, 90 * steps_per_epoch),
        beta_center=10 * steps_per_epoch, beta_period=5 * steps_per_epoch)
    ```

    References:
        - [Akiba, Suzuki and Fukuda, 2017. Extremely Large Minibatch SGD:
          Training ResNet-50 on ImageNet in 15 Minutes](
          https://arxiv.org/abs/1711.04325) (abstract).
        - Tieleman and Hinton, 2012. Lecture 6.5, rmsprop. COURSERA.
    """

    def __init__(
        self,
        learning_rate=0.1,
        rmsprop_learning_rate=3e-4,
        mu1=0.9,
        mu2=0.99,
        epsilon=1e-8,
        beta_center=10.0,
        beta_period=5.0,
        weight_decay_rate=0.0,
        exclude_from_weight_decay=None,
        name="RMSpropWarmup",
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.rmsprop_learning_rate = check_number(
            "rmsprop_learning_rate", rmsprop_learning_rate, 0.0)
        self.mu1 = check_number("mu1", mu1, 0.0, 1.0)
        self.mu2 = check_number("mu2", mu2, 0.0, 1.0)
        if self.mu2 == 1.0:
            raise ValueError(
                "`mu2` must be a number in the range [0, 1) (1 never updates "
                f"the second moment). Received: mu2={mu2!r}")
        if not (is_number(epsilon) and epsilon > 0):
            raise ValueError(
                f"`epsilon` must be a number > 0. Received: epsilon={epsilon!r}")
        self.epsilon = float(epsilon)
        self.beta_center = check_number("beta_center", beta_center, 0.0)
        if not (is_number(beta_period) and beta_period > 0):
            raise ValueError(
                "`beta_period` must be a number > 0 (steps). "
                f"Received: beta_period={beta_period!r}")
        self.beta_period = float(beta_period)
        self.weight_decay_rate = check_number(
            "weight_decay_rate", weight_decay_rate, 0.0)
        self._warmup_exclude_from_weight_decay = check_patterns(
            "exclude_from_weight_decay", exclude_from_weight_decay)

    def _decays(self, variable):
        """Whether `variable` gets `weight_decay_rate` (LARS's exclusions)."""
        return self.weight_decay_rate > 0 and not excluded(
            variable, self._warmup_exclude_from_weight_decay)

    def build(self, variables):
        """Creates the slots `second_moment` (m) and `velocity` (d)."""
        if self.built:
            return
        super().build(variables)
        self.second_moments = self.add_optimizer_variables(
            variables, "second_moment")
        self.velocities = self.add_optimizer_variables(variables, "velocity")
        # Decided here, from paths: update_step may get the raw variable.
        self._use_weight_decay_rate = [self._decays(v) for v in variables]

    def _sgd_coefficient(self, dtype):
        """`sgd_coefficient` of the current step, as a tensor."""
        # (`convert_to_tensor(x, dtype)`, not `cast`: `cast` would round a
        # Python float through float32 first.)
        x = ops.divide(
            ops.subtract(ops.cast(self.iterations, dtype),
                         ops.convert_to_tensor(self.beta_center, dtype)),
            ops.convert_to_tensor(self.beta_period, dtype))
        # exp of the clipped x: the unselected branch must not overflow.
        before = ops.multiply(0.5, ops.exp(ops.multiply(2.0, ops.minimum(x, 0.0))))
        after = ops.minimum(ops.add(0.5, x), 1.0)
        return ops.where(ops.less(x, 0.0), before, after)

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = self._get_variable_index(variable)
        var_dtype = keras.backend.standardize_dtype(variable.dtype)
        dtype = "float32" if var_dtype in ("float16", "bfloat16") else var_dtype

        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(ops.convert_to_tensor(gradient), dtype)
        if self._use_weight_decay_rate[index]:
            gradient = ops.add(gradient, ops.multiply(
                ops.convert_to_tensor(self.weight_decay_rate, dtype),
                ops.cast(variable, dtype)))

        alpha_sgd = self._sgd_coefficient(dtype)
        # eta' / eta, 0 where eta is 0 (the whole step is eta * d = 0 then).
        positive = ops.greater(lr, 0.0)
        ratio = ops.where(
            positive,
            ops.divide(ops.convert_to_tensor(self.rmsprop_learning_rate, dtype),
                       ops.where(positive, lr, 1.0)),
            0.0)
        alpha_rmsprop = ops.multiply(ops.subtract(1.0, alpha_sgd), ratio)

        m_var = self.second_moments[index]
        d_var = self.velocities[index]
        mu1 = ops.convert_to_tensor(self.mu1, dtype)
        mu2 = ops.convert_to_tensor(self.mu2, dtype)
        m = ops.add(ops.multiply(mu2, ops.cast(m_var, dtype)),
                    ops.multiply(ops.subtract(1.0, mu2), ops.square(gradient)))
        coefficient = ops.add(
            alpha_sgd,
            ops.divide(alpha_rmsprop,
                       ops.add(ops.sqrt(m), ops.convert_to_tensor(self.epsilon, dtype))))
        d = ops.subtract(ops.multiply(mu1, ops.cast(d_var, dtype)),
                         ops.multiply(coefficient, gradient))
        self.assign(m_var, ops.cast(m, m_var.dtype))
        self.assign(d_var, ops.cast(d, d_var.dtype))
        self.assign_add(variable, ops.cast(ops.multiply(lr, d), variable.dtype))

    def get_config(self):
        config = super().get_config()
        patterns = self._warmup_exclude_from_weight_decay
        config.update({
            "rmsprop_learning_rate": self.rmsprop_learning_rate,
            "mu1": self.mu1,
            "mu2": self.mu2,
            "epsilon": self.epsilon,
            "beta_center": self.beta_center,
            "beta_period": self.beta_period,
            "weight_decay_rate": self.weight_decay_rate,
            "exclude_from_weight_decay":
                None if patterns is None else list(patterns),
        })
        return config
