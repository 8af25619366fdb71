"""tfscale: the large-batch training system of Jia et al. 2018 for Keras 3."""

from tfscale.strategy import CommunicationOptions
from tfscale.strategy import Strategy

__version__ = "0.1.0"
