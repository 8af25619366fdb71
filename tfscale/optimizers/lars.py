"""LARS: layer-wise adaptive rate scaling, as a Keras 3 optimizer."""

import keras
from keras import ops

from tfscale.optimizers.exclusion import check_number
from tfscale.optimizers.exclusion import check_patterns
from tfscale.optimizers.exclusion import excluded

_LOW_PRECISION_FLOATS = ("float16", "bfloat16")


@keras.saving.register_keras_serializable(package="tfscale")
class LARS(keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling (LARS) with momentum.

    Every variable (layer) gets its own learning rate, scaled by the trust
    ratio `eeta * ||w|| / ||g||`, so that the update is a fixed fraction of
    the weight's norm whatever the gradient's scale: this is what keeps
    training stable at very large batch sizes (ResNet-50 at 64K, Jia et al.).
    Update rule for a variable `w` with gradient `g` and momentum slot `v`
    (the "classic momentum" variant of tf-models-official's LARS, whose
    argument names this follows):

    ```python
    if use_weight_decay(w):
        g = g + weight_decay_rate * w
    if use_layer_adaptation(w) and norm(w) > 0 and norm(g) > 0:
        trust_ratio = eeta * norm(w) / (norm(g) + epsilon)
    else:
        trust_ratio = 1.0
    v = momentum * v + learning_rate * trust_ratio * g
    if nesterov:
        w = w - (momentum * v + learning_rate * trust_ratio * g)
    else:
        w = w - v
    ```

    `norm` is the L2 norm over the whole variable. With `momentum=0` no slot
    is created and `w = w - learning_rate * trust_ratio * g`.

    Precision: the update is always computed in at least float32. The
    gradient and the learning rate are cast to the variable's dtype (float32
    master weights under the `mixed_float16` / `mixed_bfloat16` policies,
    where under float16 it runs inside a `LossScaleOptimizer` (use
    `tfscale.optimizers.LossScaleOptimizer` with several workers) and the
    gradients arrive unscaled); should a variable itself be
    float16 or bfloat16, the norms, the trust ratio and the update are still
    computed in float32 and only the result is cast back. Computing the
    trust ratio in float16 overflows or underflows for realistic layer norms
    (Jia et al. 2018).

    Exclusions: which variables skip weight decay / layer adaptation is
    decided once, in `build`, from the variable's path (e.g.
    `"conv1_bn/gamma"`, `"dense/bias"`):

    - `exclude_from_weight_decay=None` (default): the built-in rule, i.e.
      the path matches one of `bias`, `gamma`, `beta`, `batch_norm`,
      `(?:^|[/_])bn(?:[/_\\d]|$)`, OR the variable has rank 0 or 1
      (biases and normalization scales/offsets whatever they are called).
    - a list: exactly these regular expressions, searched (`re.search`) in
      the path; the built-in patterns and the rank-0/1 rule no longer apply
      (so tf-models-official configs port unchanged). `[]` excludes nothing.
    - `exclude_from_layer_adaptation=None` (default): the same rule as for
      weight decay (as in tf-models-official); a list (`[]` included) is
      used as given.

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance (e.g.
            `tfscale.schedules.WarmupPolynomialDecay`), or a callable that
            takes no arguments and returns the learning rate. The global
            learning rate, multiplied by each variable's trust ratio.
            Defaults to `0.01`.
        momentum: float in `[0, 1]`, the momentum coefficient. Defaults to
            `0.9`.
        weight_decay_rate: float >= 0. L2 weight decay added to the gradient
            *before* the trust ratio is computed (not the decoupled
            `weight_decay` of the base optimizer). Defaults to `0.0`.
        eeta: float >= 0, the LARS trust coefficient. Defaults to `0.001`.
        epsilon: float >= 0 added to `||g||` in the trust ratio's
            denominator. Defaults to `0.0`.
        nesterov: boolean, whether to use Nesterov momentum. Defaults to
            `False`.
        exclude_from_weight_decay: `None` or a list of regular expressions:
            variables whose path matches get no `weight_decay_rate` (see
            "Exclusions" above). Defaults to `None` (biases and BatchNorm
            parameters excluded).
        exclude_from_layer_adaptation: `None` or a list of regular
            expressions: variables whose path matches get trust ratio 1.
            Defaults to `None` (same as `exclude_from_weight_decay`).
        name: String, the name of the optimizer (and of the scope of its
            variables). Defaults to `"LARS"`.
        **kwargs: Arguments of the base `keras.optimizers.Optimizer`:
            `weight_decay` (decoupled, applied separately from and in
            addition to `weight_decay_rate`), `clipnorm`, `clipvalue`,
            `global_clipnorm`, `use_ema`, `ema_momentum`,
            `ema_overwrite_frequency`, `loss_scale_factor`,
            `gradient_accumulation_steps`.

    Example:

    ```python
    optimizer = tfscale.optimizers.LARS(
        learning_rate=tfscale.schedules.WarmupPolynomialDecay(
            initial_learning_rate=29.0, decay_steps=1000, warmup_steps=100),
        momentum=0.9, weight_decay_rate=5e-5, eeta=0.001)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    ```

    References:
        - [You et al., 2017. Large Batch Training of Convolutional Networks](
          https://arxiv.org/abs/1708.03888)
        - [Jia et al., 2018. Highly Scalable Deep Learning Training System
          with Mixed-Precision: Training ImageNet in Four Minutes](
          https://arxiv.org/abs/1807.11205)
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum=0.9,
        weight_decay_rate=0.0,
        eeta=0.001,
        epsilon=0.0,
        nesterov=False,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
        name="LARS",
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = check_number("momentum", momentum, 0.0, 1.0)
        self.weight_decay_rate = check_number(
            "weight_decay_rate", weight_decay_rate, 0.0
        )
        self.eeta = check_number("eeta", eeta, 0.0)
        self.epsilon = check_number("epsilon", epsilon, 0.0)
        if not isinstance(nesterov, bool):
            raise ValueError(
                "`nesterov` must be a boolean. "
                f"Received: nesterov={nesterov!r}"
            )
        self.nesterov = nesterov
        # Not `self.exclude_from_weight_decay`: that name is a method of the
        # base optimizer (for its decoupled `weight_decay`).
        self._lars_exclude_from_weight_decay = check_patterns(
            "exclude_from_weight_decay", exclude_from_weight_decay
        )
        self._lars_exclude_from_layer_adaptation = check_patterns(
            "exclude_from_layer_adaptation", exclude_from_layer_adaptation
        )

    def _is_excluded(self, variable, patterns):
        """Whether `variable` matches `patterns` (None: the built-in rule)."""
        return excluded(variable, patterns)

    def build(self, variables):
        """Initialize optimizer variables and per-variable flags.

        LARS has one optimizer variable per model variable, `momentum`
        (only when `self.momentum` is not 0). Whether each variable gets
        weight decay and layer adaptation is decided here, once, from the
        variables' paths: `update_step` may receive the raw backend variable
        (e.g. under `LossScaleOptimizer`), whose path is not available.

        Args:
            variables: list of model variables to build LARS variables on.
        """
        if self.built:
            return
        super().build(variables)
        self.momentums = []
        if self.momentum != 0:
            self.momentums = self.add_optimizer_variables(
                variables, "momentum"
            )
        wd_patterns = self._lars_exclude_from_weight_decay
        la_patterns = self._lars_exclude_from_layer_adaptation
        if la_patterns is None:
            la_patterns = wd_patterns
        self._use_weight_decay_rate = [
            self.weight_decay_rate > 0 and not self._is_excluded(v, wd_patterns)
            for v in variables
        ]
        self._use_layer_adaptation = [
            not self._is_excluded(v, la_patterns) for v in variables
        ]

    def _update_dtype(self, variable_dtype):
        """The dtype of the norms, the trust ratio and the update: at least
        float32 (see "Precision")."""
        if variable_dtype in _LOW_PRECISION_FLOATS:
            return "float32"
        return variable_dtype

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = self._get_variable_index(variable)
        dtype = self._update_dtype(
            keras.backend.standardize_dtype(variable.dtype))

        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(ops.convert_to_tensor(gradient), dtype)
        w = ops.cast(variable, dtype)

        if self._use_weight_decay_rate[index]:
            decay = ops.cast(self.weight_decay_rate, dtype)
            gradient = ops.add(gradient, ops.multiply(decay, w))

        if self._use_layer_adaptation[index]:
            w_norm = ops.sqrt(ops.sum(ops.square(w)))
            g_norm = ops.sqrt(ops.sum(ops.square(gradient)))
            positive = ops.logical_and(
                ops.greater(w_norm, 0), ops.greater(g_norm, 0)
            )
            # Safe denominator: the unselected branch must not divide by 0.
            denominator = ops.where(
                positive, ops.add(g_norm, ops.cast(self.epsilon, dtype)), 1.0
            )
            trust_ratio = ops.where(
                positive,
                ops.divide(
                    ops.multiply(ops.cast(self.eeta, dtype), w_norm),
                    denominator,
                ),
                ops.cast(1.0, dtype),
            )
            lr = ops.multiply(lr, trust_ratio)

        scaled_gradient = ops.multiply(lr, gradient)
        if self.momentum == 0:
            self.assign_sub(variable, scaled_gradient)
            return

        m = self.momentums[index]
        momentum = ops.cast(self.momentum, dtype)
        next_m = ops.add(
            ops.multiply(momentum, ops.cast(m, dtype)), scaled_gradient
        )
        self.assign(m, next_m)
        if self.nesterov:
            update = ops.add(ops.multiply(momentum, next_m), scaled_gradient)
        else:
            update = next_m
        self.assign_sub(variable, update)

    def get_config(self):
        config = super().get_config()

        def as_list(patterns):
            return None if patterns is None else list(patterns)

        config.update(
            {
                "momentum": self.momentum,
                "weight_decay_rate": self.weight_decay_rate,
                "eeta": self.eeta,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
                "exclude_from_weight_decay": as_list(
                    self._lars_exclude_from_weight_decay
                ),
                "exclude_from_layer_adaptation": as_list(
                    self._lars_exclude_from_layer_adaptation
                ),
            }
        )
        return config
