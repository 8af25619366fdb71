"""Optimizers for large-batch training: LARS (You et al. 2017), RMSprop
warm-up (Akiba et al. 2017), dynamic loss scaling that agrees across workers,
and HALP (De Sa et al. 2018) with its baselines SVRG and low-precision SGD.
HALP and SVRG train through `tfscale.models.VarianceReducedModel`.

LARS, RMSpropWarmup and LossScaleOptimizer are plain Keras and run on any
backend; HALP, SVRG and LowPrecisionSGD (and `quantize`) need TensorFlow:
their rounding noise is TensorFlow's stateless random numbers, the same on
every worker."""

from tfscale import _requirements
from tfscale.optimizers.lars import LARS
from tfscale.optimizers.loss_scale import LossScaleOptimizer
from tfscale.optimizers.rmsprop_warmup import RMSpropWarmup

__all__ = ["LARS", "LossScaleOptimizer", "RMSpropWarmup"]
_TENSORFLOW_ONLY = ("HALP", "LowPrecisionSGD", "SVRG", "quantize")

if _requirements.tensorflow_missing() is None:
    from tfscale.optimizers import quantize
    from tfscale.optimizers.halp import HALP
    from tfscale.optimizers.halp import SVRG
    from tfscale.optimizers.low_precision_sgd import LowPrecisionSGD

    __all__ += _TENSORFLOW_ONLY
else:
    def __getattr__(name):
        if name in _TENSORFLOW_ONLY:
            raise ModuleNotFoundError(
                _requirements.needs_tensorflow(f"tfscale.optimizers.{name}"),
                name="tensorflow")
        raise AttributeError(f"module 'tfscale.optimizers' has no attribute {name!r}")
