"""The worker side of `tfscale-bench train`: one process of a launch.

`spec["kind"]` says what it trains under: `"single"` (alone, no strategy),
`"stock"` (TF's own all-reduce, with only the Keras 3 fix) or `"tfscale"`
(`tfscale.Strategy` with the spec's algorithm and compression). Under a
strategy it first trains the model alone, while the other workers do the
same, then under the strategy; train.py turns the step times into rows.
"""

import statistics
import time


def measure(spec):
    """Trains as `spec` says on this worker.

    Returns:
        `{"rank", "runs"}`: per precision a "compute" run (alone) and, under a
        strategy, a "distributed" run, each with its per-step seconds.
    """
    import keras

    strategy, rank = None, 0
    if spec["kind"] == "stock":
        strategy = _stock_strategy_class()()
        rank = strategy.cluster_resolver.task_id or 0
        _time_stock_all_reduces(strategy)
    elif spec["kind"] == "tfscale":
        import tfscale

        strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
            algorithm=spec["algorithm"], compression=spec["compression"],
            local_size=spec["local_size"],
            fusion_threshold_bytes=spec["fusion_threshold_bytes"],
            timeout_seconds=spec["collective_timeout"]))
        rank = strategy.worker_index
    barrier = _barrier(strategy) if strategy else (lambda: None)
    runs = []
    for precision in spec["precisions"]:
        keras.mixed_precision.set_global_policy(precision)
        barrier()
        runs.append({"precision": precision, "phase": "compute",
                     **_fit(spec, None)})
        if strategy is not None:
            barrier()
            runs.append({"precision": precision, "phase": "distributed",
                         **_fit(spec, strategy)})
        if rank == 0:
            print(f"{spec['name']} {precision}: " + ", ".join(
                f"{r['phase']} median {statistics.median(r['step_seconds']):.3f} s/step"
                for r in runs if r["precision"] == precision), flush=True)
    keras.mixed_precision.set_global_policy("float32")
    return {"rank": rank, "runs": runs}


def _stock_strategy_class():
    import tensorflow as tf

    class StockStrategy(tf.distribute.MultiWorkerMirroredStrategy):
        """Stock MWMS plus the one change Keras 3 `fit` needs on 2+ workers:
        `reduce` maps over nests and drops `axis` for rank-0 values (as
        tfscale.Strategy.reduce does; keras-team/keras#20585). Gradients take
        TF's own CollectiveAllReduce."""

        def reduce(self, reduce_op, value, axis=None):
            parent = super().reduce

            def reduce_one(v):
                t = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
                rank = tf.convert_to_tensor(t).shape.rank
                return parent(reduce_op, v, axis=None if rank == 0 else axis)

            return tf.nest.map_structure(reduce_one, value)

    return StockStrategy


def _time_stock_all_reduces(strategy):
    """Gives a stock strategy the `exposed_communication_seconds` of tfscale's,
    timed the same way around TF's own all-reduce (which stays as it is)."""
    import tensorflow as tf

    from tfscale import _tf_private

    with tf.device(strategy.extended.worker_devices[0]):
        strategy.exposed_communication_seconds = tf.Variable(0.0, dtype=tf.float64,
                                                             trainable=False)
    _tf_private.time_stock_all_reduces(strategy, strategy.exposed_communication_seconds)


def _barrier(strategy):
    import tensorflow as tf

    @tf.function
    def barrier():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.identity(tf.constant([1.0]))))

    return lambda: barrier()


def _fit(spec, strategy):
    """Timed steps of `model.fit`; alone when `strategy` is None.

    Returns:
        `{"step_seconds": [...]}`, plus `"exposed_comm_seconds": [...]` (per
        step, measured in the step) under a `tfscale.Strategy`.
    """
    import contextlib

    import keras

    import models
    from tfscale import data

    exposed = getattr(strategy, "exposed_communication_seconds", None)

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if exposed is not None:
                self.exposed_before = exposed.numpy()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)
            if exposed is not None:
                waits.append(float(exposed.numpy() - self.exposed_before))

    times, waits = [], []
    size = spec["image_size"]
    options = {"fc_units": spec["fc_units"]} if spec["model"] == "alexnet_bn" else {}
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = models.get(spec["model"], num_classes=1000,
                           input_shape=(size, size, 3), **options)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = spec["per_worker_batch"]
    if strategy is None:
        dataset = data.synthetic(batch, size)
    else:
        global_batch = batch * strategy.num_replicas_in_sync
        dataset = strategy.distribute_datasets_from_function(
            lambda context: data.synthetic(global_batch, size, input_context=context))
    model.fit(dataset, epochs=1, steps_per_epoch=spec["warmup_steps"] + spec["steps"],
              callbacks=[StepTimer()], verbose=0)
    timed = {"step_seconds": times[spec["warmup_steps"]:]}
    if exposed is not None:
        timed["exposed_comm_seconds"] = waits[spec["warmup_steps"]:]
    return timed
