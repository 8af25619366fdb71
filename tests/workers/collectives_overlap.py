"""Times, inside each training step, when the first fused bucket's sum was
ready and when the last gradient was, and reports the gap.

An MLP of equal layers (4 MiB kernels) with 4 MiB buckets: about one bucket
per layer, so the first bucket (the last layers) can be summed while earlier
layers are still being differentiated. The two timestamps are taken in the
step's own graph (`tf.timestamp` behind control dependencies) by a wrapper of
`fused_all_reduce` in tfscale/collectives/all_reduce.py, where `AllReduce`
calls it. (The TF profiler was used here first; its
export crashed with SIGSEGV now and then under load.)

`tf.function` runs stateful ops that take no resource, such as `Timestamp`,
in the order they were created: the first bucket's timestamp is created
first, so the gradients' one reads max(last gradient ready, first sum ready),
and the gap is positive only where the sum came first. For the same reason
the strategy's own timing (`exposed_communication_seconds`, whose first
timestamp waits for every gradient) is switched off here
(`CommunicationOptions(time_all_reduces=False)`).
"""

import numpy as np
import tensorflow as tf
from absl import app

import keras
import tfscale
from report import report
from sharded_data import round_robin
from tfscale.collectives import all_reduce as all_reduce_lib

LAYERS, WIDTH, GLOBAL_BATCH, STEPS = 8, 1024, 2048, 8


def dataset_fn(input_context):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, WIDTH)).astype("float32")
    y = rng.integers(0, 10, 4096)
    return round_robin(x, y, input_context, GLOBAL_BATCH)


class FirstBucketClock:
    """Wraps `fused_all_reduce`. For the gradient list (the call
    with `num_gradients` tensors) it stores in `self.seconds` the time the
    first bucket's sum was ready, then the time the last gradient was."""

    def __init__(self, num_gradients):
        self.num_gradients = num_gradients
        self.seconds = tf.Variable(tf.zeros([2], tf.float64), trainable=False)
        self.original = all_reduce_lib.fused_all_reduce

    def __call__(self, tensors, groups, buckets, *args, **kwargs):
        results = self.original(tensors, groups, buckets, *args, **kwargs)
        if len(tensors) != self.num_gradients:  # a loss or metric reduce
            return results
        with tf.control_dependencies([results[i] for i in buckets[0].indices]):
            first_sum_ready = tf.timestamp()
        with tf.control_dependencies(tensors):
            gradients_ready = tf.timestamp()
        self.seconds.assign(tf.stack([first_sum_ready, gradients_ready]))
        return results


class PerStep(keras.callbacks.Callback):
    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.gaps_ms = []

    def on_train_batch_end(self, batch, logs=None):
        first_sum_ready, gradients_ready = self.clock.seconds.numpy()
        self.gaps_ms.append(1000 * (gradients_ready - first_sum_ready))


def main(argv):
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm="ring", fusion_threshold_bytes=4 << 20, timeout_seconds=120,
        time_all_reduces=False))  # see the docstring
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)]
            + [keras.layers.Dense(10)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    gradients = [v.value for v in model.trainable_variables]
    plan = strategy.all_reduce_plan(gradients)
    clock = FirstBucketClock(len(gradients))
    all_reduce_lib.fused_all_reduce = clock
    per_step = PerStep(clock)
    model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1,
              steps_per_epoch=STEPS, verbose=0, callbacks=[per_step])
    report({
        "worker_index": strategy.worker_index,
        "buckets": [[len(b.indices), b.size_bytes] for b in plan],
        # Per step: ms from the first bucket's sum to the last gradient
        # (positive: summed while backprop still ran).
        "first_sum_before_last_gradient_ms": per_step.gaps_ms,
    })


if __name__ == "__main__":
    app.run(main)
