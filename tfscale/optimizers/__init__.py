"""Optimizers for large-batch training: LARS (You et al. 2017), RMSprop
warm-up (Akiba et al. 2017), dynamic loss scaling that agrees across workers,
and HALP (De Sa et al. 2018) with its baselines SVRG and low-precision SGD.
HALP and SVRG train through `tfscale.models.VarianceReducedModel`."""

from tfscale.optimizers import quantize
from tfscale.optimizers.halp import HALP
from tfscale.optimizers.halp import SVRG
from tfscale.optimizers.lars import LARS
from tfscale.optimizers.loss_scale import LossScaleOptimizer
from tfscale.optimizers.low_precision_sgd import LowPrecisionSGD
from tfscale.optimizers.rmsprop_warmup import RMSpropWarmup

__all__ = ["HALP", "LARS", "LossScaleOptimizer", "LowPrecisionSGD",
           "RMSpropWarmup", "SVRG", "quantize"]
