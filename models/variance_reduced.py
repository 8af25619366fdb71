"""`model.fit` for SVRG and HALP: the anchor gradient and the full gradient."""

import keras
import tensorflow as tf

# What this model calls on its optimizer, beyond Keras's (tfscale.optimizers'
# HALP and SVRG have them). Duck typing keeps models/ free of imports from
# the rest of tfscale.
_VARIANCE_REDUCED_METHODS = ("recenter", "set_full_gradient", "apply_variance_reduced")


class VarianceReducedModel(keras.Model):
    """Wraps a Keras model so that `fit` trains it with `HALP` or `SVRG`.

    SVRG and HALP need what a Keras optimizer never sees: the gradient of
    the step's batch at the anchor point `w~` as well as at the current
    weights, and every `epoch_length` steps the full gradient of the loss
    over the whole training set. This model's `train_step` evaluates the
    batch's loss twice, at the weights and (without touching them, through
    `keras.StatelessScope`) at the optimizer's anchor, and hands the
    difference to the optimizer; before every `epoch_length`-th step it
    re-centres the optimizer on the current weights and computes the full
    gradient there over `full_gradient_data` (De Sa et al. 2018; the
    reference implementation, HazyResearch/torchhalp's
    `torchhalp/optim/halp.py`, does the same from a closure and a data
    loader).

    ```python
    with strategy.scope():  # tfscale.Strategy(), or none
        model = keras.Sequential([...])  # regularizers in the model
        trainer = tfscale.models.VarianceReducedModel(
            model, full_gradient_data=train_dataset)  # finite, batched (x, y)
        trainer.compile(
            optimizer=tfscale.optimizers.HALP(
                learning_rate=0.5, epoch_length=32, bits=8, mu=0.1),
            loss=keras.losses.BinaryCrossentropy(from_logits=True))
    trainer.fit(train_dataset.repeat(), steps_per_epoch=..., epochs=...)
    model.export(...)  # the wrapped model holds the weights
    ```

    Multi-worker: under `tfscale.Strategy` the step's gradient difference is
    all-reduced as any optimizer's gradients are; for the full gradient,
    worker `i` of `n` takes batches `i, i + n, ...` of `full_gradient_data`
    (give every worker the same, whole, dataset), and the per-worker sums
    and example counts are all-reduced once, so `g~` is the mean gradient
    over every example, whatever the number of workers.

    The anchor's forward pass runs with `training=True` and its state
    updates (BatchNorm statistics, dropout's random state) are discarded:
    HALP's theory is for convex losses; with dropout the two evaluations
    draw different masks.

    Args:
        model: the `keras.Model` to train; its weights are the current
            iterate `w = w~ + z` after every step.
        full_gradient_data: a finite `tf.data.Dataset` of `(x, y)` or
            `(x, y, sample_weight)` batches: the training set, over which
            the full gradient is the mean of the per-example gradients
            (the model's loss reduced by its mean, plus its regularization
            losses). The same on every worker.
        **kwargs: `keras.Model` arguments (`name`).
    """

    def __init__(self, model, full_gradient_data, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(model, keras.Model):
            raise TypeError(
                "Argument `model` must be a `keras.Model`. "
                f"Received: model={model!r}")
        if not isinstance(full_gradient_data, tf.data.Dataset):
            raise TypeError(
                "Argument `full_gradient_data` must be a `tf.data.Dataset` of "
                "(x, y) batches covering the training set once, e.g. "
                "`tf.data.Dataset.from_tensor_slices((x, y)).batch(256)`. "
                f"Received: full_gradient_data={full_gradient_data!r}")
        if full_gradient_data.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "Argument `full_gradient_data` must be finite (one pass over "
                "the training set); this one repeats forever. Drop its "
                f"`.repeat()`. Received: full_gradient_data={full_gradient_data!r}")
        self.model = model
        self.full_gradient_data = full_gradient_data
        self._batch_gradient_sum = None
        self._all_reduce_sum = None

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def compile(self, optimizer, **kwargs):
        """`keras.Model.compile`; `optimizer` must be a `tfscale.optimizers.HALP`
        (or `SVRG`)."""
        if not all(callable(getattr(optimizer, name, None))
                   for name in _VARIANCE_REDUCED_METHODS):
            raise TypeError(
                "VarianceReducedModel trains with `tfscale.optimizers.HALP` or "
                "`tfscale.optimizers.SVRG`; for any other optimizer compile "
                f"the model itself. Received: optimizer={optimizer!r}")
        super().compile(optimizer=optimizer, **kwargs)

    def make_train_function(self, force=False):
        """Keras's train function, preceded by the epoch's start when due."""
        if self.train_function is not None and not force:
            return self.train_function
        epoch_length = self.optimizer.epoch_length
        if epoch_length % self.steps_per_execution:
            raise ValueError(
                "`steps_per_execution` must divide the optimizer's "
                f"`epoch_length` ({epoch_length}), so that every full gradient "
                "falls between two executions. Received: "
                f"steps_per_execution={self.steps_per_execution}")
        super().make_train_function(force=force)
        steps = self.train_function

        def train_function(iterator):
            self.start_epoch_if_due()
            return steps(iterator)

        self.train_function = train_function
        return train_function

    def start_epoch_if_due(self):
        """Re-centres the optimizer and takes the full gradient when the
        optimizer's step count is a multiple of its `epoch_length`."""
        optimizer = self.optimizer
        variables = self.trainable_variables
        if not optimizer.built:
            with self.distribute_strategy.scope():
                optimizer.build(variables)
        iterations = int(keras.ops.convert_to_numpy(optimizer.iterations))
        if iterations % optimizer.epoch_length:
            return
        optimizer.recenter(variables)
        optimizer.set_full_gradient(self.full_gradient())

    def full_gradient(self):
        """The mean gradient over every example of `full_gradient_data` at
        the current weights, this worker's share summed with the others'."""
        strategy = self.distribute_strategy
        num_workers, worker = _worker_share(strategy)
        data = self.full_gradient_data
        if num_workers > 1:
            data = data.shard(num_workers, worker)
        if self._batch_gradient_sum is None:
            self._batch_gradient_sum = tf.function(
                self._replicated(self._gradient_sum), reduce_retracing=True)
            self._all_reduce_sum = tf.function(self._replicated(_all_reduce_sum))
        variables = self.trainable_variables
        sums = [tf.zeros(v.shape, v.dtype) for v in variables]
        count = tf.zeros((), variables[0].dtype)
        for batch in data:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            batch_sums, batch_count = self._batch_gradient_sum(x, y, sample_weight)
            sums = [s + b for s, b in zip(sums, batch_sums)]
            count += batch_count
        *sums, count = self._all_reduce_sum(sums + [count])
        if float(count) == 0:
            raise ValueError(
                "`full_gradient_data` yielded no examples on any worker: it "
                "must cover the training set.")
        return [s / count for s in sums]

    def gradients_at(self, values, x, y, sample_weight=None):
        """The gradient of the batch's loss with the trainable variables set
        to `values` (tensors), leaving the variables and all other state as
        they are; scaled as Keras scales a replica's loss."""
        values = [tf.convert_to_tensor(v) for v in values]
        with tf.GradientTape() as tape:
            tape.watch(values)
            mapping = list(zip(self.trainable_variables, values))
            with keras.StatelessScope(state_mapping=mapping):
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred,
                                         sample_weight=sample_weight, training=True)
        gradients = tape.gradient(loss, values)
        # A variable the loss does not reach (an unused layer) has gradient 0.
        return [tf.zeros_like(v) if g is None else g for g, v in zip(gradients, values)]

    def train_step(self, data):
        """One SVRG/HALP step: `g_i(w) - g_i(w~)` to the optimizer, which adds
        the full gradient after the all-reduce."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        variables = self.trainable_variables
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred,
                                     sample_weight=sample_weight, training=True)
        gradients = tape.gradient(loss, variables)
        anchor_gradients = self.gradients_at(optimizer.anchors, x, y, sample_weight)
        optimizer.apply_variance_reduced(
            [g - a for g, a in zip(gradients, anchor_gradients)], variables)
        # Keras divides each replica's loss by the number of replicas.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss * replicas, sample_weight=batch_size)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _gradient_sum(self, x, y, sample_weight):
        """Replica function: the sum of the batch's per-example gradients (its
        mean loss's gradient times its size) and its size."""
        variables = self.trainable_variables
        gradients = self.gradients_at(variables, x, y, sample_weight)
        size = tf.cast(tf.shape(tf.nest.flatten(x)[0])[0], variables[0].dtype)
        weight = size * tf.distribute.get_strategy().num_replicas_in_sync
        return [g * tf.cast(weight, g.dtype) for g in gradients], size

    def _replicated(self, replica_function):
        """`replica_function` run by the strategy, this worker's result."""
        strategy = self.distribute_strategy

        def run(*args):
            result = strategy.run(replica_function, args=args)
            return tf.nest.map_structure(
                lambda value: strategy.experimental_local_results(value)[0], result)

        return run


def _all_reduce_sum(values):
    # Copied inside the replica function, so that each value is placed on the
    # replica's device: the strategy reduces to where its inputs live.
    values = [tf.identity(v) for v in values]
    return tf.distribute.get_replica_context().all_reduce("sum", values)


def _worker_share(strategy):
    """(number of workers, this worker's index) for sharding the full pass:
    a tfscale strategy's (any with `num_workers` and `worker_index`, one
    replica per worker), or (1, 0) with one replica."""
    if hasattr(strategy, "num_workers") and hasattr(strategy, "worker_index"):
        return strategy.num_workers, strategy.worker_index
    if strategy.num_replicas_in_sync == 1:
        return 1, 0
    raise ValueError(
        "VarianceReducedModel shards its full-gradient pass by worker and "
        "runs one replica per worker: use `tfscale.Strategy` (or no strategy). "
        f"Received: a {type(strategy).__name__} with "
        f"{strategy.num_replicas_in_sync} replicas")
