"""HALP (SVRG with bit centering) and plain SVRG, as Keras 3 optimizers.

Both need two gradients per step, at the current point and at the anchor,
on the same batch, and a full gradient every `epoch_length` steps: train
with `tfscale.models.VarianceReducedModel`, which computes them.
"""

import keras
from keras import ops
import tensorflow as tf

from tfscale._validation import is_int
from tfscale._validation import is_number
from tfscale.optimizers import quantize

# Base-optimizer arguments that would act on the variance-reduced direction
# or on the weights behind HALP's back (z must stay on its grid), with the
# values that leave them off (those a saved config holds).
_REFUSED_KWARGS = {
    "weight_decay": (None, 0), "clipnorm": (None,), "clipvalue": (None,),
    "global_clipnorm": (None,), "use_ema": (False,),
    "gradient_accumulation_steps": (None, 1), "loss_scale_factor": (None,),
}


def _is_off(value, off_values):
    return any(value is off or (off is not None and not isinstance(off, bool)
                                and not isinstance(value, bool) and value == off)
               for off in off_values)


@keras.saving.register_keras_serializable(package="tfscale")
class HALP(keras.optimizers.Optimizer):
    """High-accuracy low-precision training: SVRG with bit centering.

    SVRG (Johnson and Zhang 2013) takes, every `epoch_length` (T) steps, the
    full gradient `g~` of the training loss at an anchor point `w~`; each step
    then moves along `g_i(w) - g_i(w~) + g~` (`g_i`: the gradient of the
    step's batch), whose variance vanishes as `w` and `w~` approach the
    optimum. HALP (De Sa et al. 2018, the algorithm box "HALP") keeps the model
    at `w = w~ + z` where the offset `z` lives on a `bits`-bit fixed-point
    grid whose scale shrinks with the full gradient, so the quantization
    noise shrinks as training converges ("bit centering"):

    ```python
    for each epoch k (every epoch_length steps):
        w~ = w~ + z                                     # re-centre
        g~ = full_gradient(w~)                          # all examples, all workers
        s = norm(g~) / (mu * (2**(bits - 1) - 1))       # grid scale
        z = 0
        for t in range(epoch_length):
            v = g_i(w~ + z) - g_i(w~) + g~              # same batch i twice
            z = Q_s(z - learning_rate * v)              # stochastic rounding
            w = w~ + z                                  # the model's weights
    ```

    `Q_s` rounds each entry to a neighbouring multiple of `s` at random,
    unbiased, and clamps it to `[-2**(bits-1) * s, (2**(bits-1) - 1) * s]`
    (`tfscale.optimizers.quantize`). For a `mu`-strongly convex loss,
    `norm(w~ - w*) <= norm(g~) / mu`, so the grid covers the optimum; with
    enough steps per epoch HALP keeps SVRG's linear rate with a fixed number
    of bits (the paper's convergence theorem for HALP), where low-precision SGD stalls at a
    noise floor set by its fixed grid. `norm` is the L2 norm over all
    variables together, as in the paper; the reference implementation
    (HazyResearch/torchhalp, `torchhalp/optim/halp.py`) takes one scale per
    variable. `bits=None` is plain SVRG (`tfscale.optimizers.SVRG`): `z`
    is not rounded.

    Under `tfscale.Strategy` the step's gradient difference is all-reduced
    as any Keras optimizer's gradients are (so `g_i` is the global batch's)
    and the full gradient sums every worker's share of the training set. The
    rounding noise comes from `tfscale.optimizers.quantize.rounding_noise`
    keyed by `seed`, the step and the variable: the same on every worker,
    so the workers keep identical weights.

    Args:
        learning_rate: the inner step size (the paper's alpha): a float, a
            `keras.optimizers.schedules.LearningRateSchedule`, or a callable.
        epoch_length: T, the steps between full gradients (re-centrings).
            The paper's experiments take one or two passes over the data.
        bits: b, the bits of the offset `z` (>= 2); `None`: no rounding.
        mu: the strong-convexity constant the grid's scale assumes (> 0).
            Smaller `mu` covers more ground with a coarser grid.
        seed: integer key of the rounding noise.
        name: the optimizer's name. Defaults to `"HALP"`.
        **kwargs: `keras.optimizers.Optimizer` arguments, except those that
            would change the direction or the weights behind HALP's back
            (`weight_decay`, clipping, `use_ema`,
            `gradient_accumulation_steps`, `loss_scale_factor`): put weight
            decay in the loss (e.g. `kernel_regularizer`), where the full
            gradient sees it too.

    References:
        - [De Sa et al., 2018. High-Accuracy Low-Precision Training](
          https://arxiv.org/abs/1803.03383)
        - [Johnson and Zhang, 2013. Accelerating Stochastic Gradient Descent
          using Predictive Variance Reduction](
          https://papers.nips.cc/paper/4937)
    """

    def __init__(self, learning_rate=0.01, epoch_length=100, bits=8, mu=1.0,
                 seed=0, name="HALP", **kwargs):
        refused = sorted(k for k in kwargs if k in _REFUSED_KWARGS
                         and not _is_off(kwargs[k], _REFUSED_KWARGS[k]))
        if refused:
            raise ValueError(
                f"{type(self).__name__} does not take {refused}: they would act "
                "on the variance-reduced direction or move the weights off "
                "their grid. Put weight decay in the loss (e.g. a "
                "`kernel_regularizer`). Received: "
                + ", ".join(f"{k}={kwargs[k]!r}" for k in refused))
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if not is_int(epoch_length) or epoch_length < 1:
            raise ValueError(
                "Argument `epoch_length` must be an integer >= 1 (steps "
                f"between full gradients). Received: epoch_length={epoch_length!r}")
        self.epoch_length = int(epoch_length)
        self.bits = quantize.check_bits(bits, allow_none=True)
        if not is_number(mu) or mu <= 0:
            raise ValueError(
                f"Argument `mu` must be a number > 0. Received: mu={mu!r}")
        self.mu = float(mu)
        if not is_int(seed):
            raise ValueError(f"Argument `seed` must be an integer. Received: seed={seed!r}")
        self.seed = int(seed)
        self._in_variance_reduced_step = False

    def build(self, variables):
        """Creates, per model variable, the anchor `w~`, the full gradient
        `g~` and the offset `z`, and the grid scale `s` (a scalar)."""
        if self.built:
            return
        super().build(variables)
        self.anchors = self.add_optimizer_variables(variables, "anchor")
        self.full_gradients = self.add_optimizer_variables(variables, "full_gradient")
        self.offsets = self.add_optimizer_variables(variables, "offset")
        dtype = variables[0].dtype if variables else "float32"
        self.scale = self.add_variable(shape=(), dtype=dtype, initializer="zeros",
                                       name="scale")

    def recenter(self, variables):
        """Starts an epoch: `w~ = w` (that is, `w~ + z`) and `z = 0`.

        `VarianceReducedModel` calls it every `epoch_length` steps, between
        two steps, then `set_full_gradient` with the full gradient at `w~`.
        """
        for anchor, offset, variable in zip(self.anchors, self.offsets, variables):
            anchor.assign(variable)
            offset.assign(tf.zeros_like(offset))

    def set_full_gradient(self, full_gradient):
        """Stores `g~` and the grid scale `s = norm(g~) / (mu (2**(b-1) - 1))`."""
        for stored, gradient in zip(self.full_gradients, full_gradient):
            stored.assign(gradient)
        if self.bits is not None:
            norm = tf.linalg.global_norm([tf.cast(g, self.scale.dtype)
                                         for g in full_gradient])
            self.scale.assign(norm / (self.mu * (2.0 ** (self.bits - 1) - 1)))

    def apply(self, grads, trainable_variables=None):
        if not self._in_variance_reduced_step:
            raise ValueError(
                f"{type(self).__name__} needs the gradient at the anchor point "
                "and the full gradient as well as the step's gradient: train "
                "with `tfscale.models.VarianceReducedModel(model)` "
                "(compile and fit that), not with the model itself.")
        return super().apply(grads, trainable_variables)

    def apply_variance_reduced(self, gradient_differences, variables):
        """Applies one step from `g_i(w) - g_i(w~)` (the full gradient is
        added here, after the differences are all-reduced)."""
        self._in_variance_reduced_step = True
        try:
            return self.apply(gradient_differences, variables)
        finally:
            self._in_variance_reduced_step = False

    def update_step(self, gradient, variable, learning_rate):
        """`z = Q(z - lr (gradient + g~))`, `w = w~ + z`."""
        index = self._get_variable_index(variable)
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        direction = ops.add(ops.cast(gradient, dtype), self.full_gradients[index])
        offset = self.offsets[index]
        moved = ops.subtract(offset, ops.multiply(lr, direction))
        if self.bits is not None:
            noise = quantize.rounding_noise(self.seed, self.iterations, index,
                                            ops.shape(moved), dtype)
            moved = quantize.stochastic_round(
                moved, ops.cast(self.scale, dtype), self.bits, noise)
        self.assign(offset, moved)
        self.assign(variable, ops.add(self.anchors[index], moved))

    def get_config(self):
        config = super().get_config()
        config.update({"epoch_length": self.epoch_length, "bits": self.bits,
                       "mu": self.mu, "seed": self.seed})
        return config


@keras.saving.register_keras_serializable(package="tfscale")
class SVRG(HALP):
    """Stochastic variance-reduced gradient: `HALP` at full precision.

    Every `epoch_length` steps the full gradient `g~` at the anchor `w~` (the
    current weights); each step `w = w - learning_rate * (g_i(w) - g_i(w~) +
    g~)` on the step's batch `i` (Johnson and Zhang 2013, the last iterate
    as the next anchor; HazyResearch/torchhalp, `torchhalp/optim/svrg.py`). Train
    with `tfscale.models.VarianceReducedModel`.

    Args:
        learning_rate: the step size.
        epoch_length: steps between full gradients.
        name: the optimizer's name. Defaults to `"SVRG"`.
        **kwargs: as `HALP`'s.
    """

    def __init__(self, learning_rate=0.01, epoch_length=100, name="SVRG", **kwargs):
        kwargs.pop("bits", None)  # from_config of a HALP-shaped config
        kwargs.pop("mu", None)
        kwargs.pop("seed", None)
        super().__init__(learning_rate=learning_rate, epoch_length=epoch_length,
                         bits=None, name=name, **kwargs)

    def get_config(self):
        config = super().get_config()
        for key in ("bits", "mu", "seed"):
            config.pop(key)
        return config
