"""`SyncBatchNormStatistics`: one set of BatchNorm statistics on every worker."""

import keras
import tensorflow as tf

from tfscale import _tf_private


def batch_norm_statistics(model):
    """The moving mean/variance variables of every BatchNormalization layer."""
    variables = []
    for layer in _tf_private.flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            variables += [layer.moving_mean, layer.moving_variance]
    return variables


def batch_norm_synchronizer(model, strategy):
    """A function that averages BatchNorm moving statistics across workers.

    Each worker updates them from its own batches, so they drift apart (the
    variables are not aggregated). Call the returned function on EVERY worker,
    at the same point, before a checkpoint or export so all hold the same
    statistics. Build it once: each build traces a new graph.
    """
    variables = [v.value for v in batch_norm_statistics(model)]
    if not variables or strategy.num_replicas_in_sync == 1:
        return lambda: None

    @tf.function
    def sync():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            means = context.all_reduce(
                tf.distribute.ReduceOp.MEAN, [v.read_value() for v in variables]
            )
            for variable, mean in zip(variables, means):
                variable.assign(mean)

        strategy.run(replica_fn)

    return sync


class SyncBatchNormStatistics(keras.callbacks.Callback):
    """Averages BatchNorm moving statistics across workers after every epoch."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self._sync = None

    def on_epoch_end(self, epoch, logs=None):
        if self._sync is None:
            self._sync = batch_norm_synchronizer(self.model, self.strategy)
        self._sync()
