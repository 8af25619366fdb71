"""Optimizers for large-batch training: LARS (You et al. 2017) and dynamic
loss scaling that agrees across workers."""

from tfscale.optimizers.lars import LARS
from tfscale.optimizers.loss_scale import LossScaleOptimizer

__all__ = ["LARS", "LossScaleOptimizer"]
