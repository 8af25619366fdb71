"""A fast fit, then worker 1 stalls (alive, sleeping) inside an epoch.

Reports the worker's thread count before and after 300 steps of the fast fit
(under the default 300 s collective timeout), then, for the stall, how long
this worker waited before its collectives failed and with what message.
"""

import time

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
from report import report
from report import result_path
from report import wait_for_file
from report import worker_index

flags.DEFINE_float("stall_timeout", 5, "Collective timeout of the stalled fit.")
FLAGS = flags.FLAGS


def threads():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads")).split()[1])


def fit(strategy, steps, callbacks=()):
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=list(callbacks))


class Stall(keras.callbacks.Callback):
    """Worker 1 sleeps before batch 3 until worker 0 has reported (its
    collectives stopped), at most 4 timeouts; the others note when they got
    there."""

    def __init__(self):
        super().__init__()
        self.started = None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3:
            self.started = time.monotonic()
            if worker_index() == 1:
                wait_for_file(result_path(0), 4 * FLAGS.stall_timeout)


def main(argv):
    del argv
    strategy = tfscale.Strategy()  # the default timeout: 300 s
    fit(strategy, 20)  # traced; threads settle
    before = threads()
    fit(strategy, 300)
    result = {"threads_before": before, "threads_after": threads()}
    stalled = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        timeout_seconds=FLAGS.stall_timeout))
    stall = Stall()
    try:
        fit(stalled, 50, [stall])
        result["stall"] = None
    except tf.errors.OpError as error:
        result["stall"] = {"seconds": time.monotonic() - stall.started,
                           "error": str(error)}
    report(result)


if __name__ == "__main__":
    app.run(main)
