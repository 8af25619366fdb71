"""`SyncBatchNormStatistics`: one set of BatchNorm statistics on every worker."""

import keras
import tensorflow as tf

from tfscale._private import accessors


def batch_norm_statistics(model):
    """The moving mean/variance variables of every BatchNormalization layer."""
    variables = []
    for layer in accessors.flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            variables += [layer.moving_mean, layer.moving_variance]
    return variables


def batch_norm_synchronizer(model, strategy):
    """A function that averages BatchNorm moving statistics across workers.

    Each worker updates them from its own batches, so they drift apart (the
    variables are not aggregated). Call the returned function on EVERY worker,
    at the same point, before a checkpoint or export so all hold the same
    statistics. Build it once: each build traces a new graph.

    Statistics that already agree stay bitwise unchanged, so the checkpoint
    written at the last step and the export synced after it hold the same
    ones (a plain float32 mean of n equal values is not always that value).
    """
    variables = [v.value for v in batch_norm_statistics(model)]
    if not variables or strategy.num_replicas_in_sync == 1:
        return lambda: None

    @tf.function
    def sync():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            first = tf.equal(context.replica_id_in_sync_group, 0)
            values = [v.read_value() for v in variables]
            # The first replica's values, exactly: x + 0 + ... + 0 is x.
            references = context.all_reduce(
                tf.distribute.ReduceOp.SUM,
                [tf.where(first, x, tf.zeros_like(x)) for x in values])
            # The mean as reference + mean deviation: the deviations are 0
            # where the workers agree.
            deviations = context.all_reduce(
                tf.distribute.ReduceOp.MEAN,
                [x - r for x, r in zip(values, references)])
            for variable, reference, deviation in zip(
                    variables, references, deviations):
                variable.assign(reference + deviation)

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
