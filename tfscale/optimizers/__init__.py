"""Optimizers for large-batch training: LARS (You et al. 2017)."""

from tfscale.optimizers.lars import LARS

__all__ = ["LARS"]
