"""Trains with worker 1 held back and reports each worker's exposed
communication per step, read from `Strategy.exposed_communication_seconds`.

Worker 1 sleeps --delay seconds in its forward pass every step, so worker 0's
gradients are ready that much earlier and its all-reduce waits for worker 1's;
worker 1's own wait is only the (tiny) all-reduce.
"""

import time

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
from report import report
from sharded_data import round_robin

flags.DEFINE_float("delay", 1.0, "Seconds worker 1 sleeps in each forward pass.")
flags.DEFINE_string("algorithm", "ring", "tfscale.CommunicationOptions algorithm.")
FLAGS = flags.FLAGS

STEPS, GLOBAL_BATCH = 5, 16


class HoldBack(keras.layers.Layer):
    """Identity that first sleeps `delay` seconds (once its input is ready)."""

    def __init__(self, delay, **kwargs):
        super().__init__(**kwargs)
        self.delay = delay

    def call(self, x):
        def sleep(value):
            time.sleep(self.delay)
            return tf.zeros_like(value)

        slept = tf.py_function(sleep, [x], x.dtype)
        return x + tf.stop_gradient(tf.reshape(slept, tf.shape(x)))


def dataset_fn(input_context):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 4, 64)
    return round_robin(x, y, input_context, GLOBAL_BATCH)


def main(argv):
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm=FLAGS.algorithm, local_size=1, timeout_seconds=120))
    delay = FLAGS.delay if strategy.worker_index == 1 else 0.0
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            HoldBack(delay), keras.layers.Dense(4)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    per_step = tfscale.callbacks.StepTimer(strategy)
    model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1,
              steps_per_epoch=STEPS, verbose=0, callbacks=[per_step])
    report({"worker_index": strategy.worker_index,
            "seconds": per_step.exposed_communication_seconds})


if __name__ == "__main__":
    app.run(main)
