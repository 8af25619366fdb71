"""tfscale: the large-batch training system of Jia et al. 2018 for Keras 3.

    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(...))
    with strategy.scope():
        model.compile(optimizer=tfscale.optimizers.LARS(...), ...)
    model.fit(...)
"""

from tfscale import batch_growth
from tfscale import callbacks
from tfscale import data
from tfscale import evaluator
from tfscale import optimizers
from tfscale import recipes
from tfscale import schedules
from tfscale import slurm
from tfscale.startup import StartupError
from tfscale.collectives.options import CommunicationOptions
from tfscale.collectives.options import PowerSGDOptions
from tfscale.strategy import Strategy

__version__ = "0.1.0"
