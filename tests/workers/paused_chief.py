"""The chief stops (SIGSTOP) for --pause seconds between two fits.

To the other workers a stopped chief looks like a heartbeat reply held up:
its coordination service answers nothing until it continues, as when the
reply waits behind the model's tensors on a saturated link. Each worker
trains 3 steps; the chief has a child process stop it and continue it
after --pause seconds; every worker then trains 3 more. Each reports how
its second fit ended; a worker whose fit failed exits 1 after reporting,
so that tfscale-launch stops the others.
"""

import os
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
from report import report
from report import worker_index

flags.DEFINE_float("pause", 12, "Seconds the chief is stopped.")
flags.DEFINE_float("heartbeat_timeout", None,
                   "Strategy(heartbeat_timeout_seconds=...); unset: its default.")
FLAGS = flags.FLAGS


def fit(model, steps):
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)


def main(argv):
    del argv
    options = ({} if FLAGS.heartbeat_timeout is None
               else {"heartbeat_timeout_seconds": FLAGS.heartbeat_timeout})
    strategy = tfscale.Strategy(**options)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(model, 3)
    result = {}
    if worker_index() == 0:
        start = last = time.monotonic()
        pid = os.getpid()
        subprocess.Popen(["sh", "-c", f"kill -STOP {pid}; sleep {FLAGS.pause}; kill -CONT {pid}"])
        # Sleeps through the stop, which shows as one long gap between two
        # turns of the loop; wakes once continued.
        result["stopped_seconds"] = 0.0
        while last - start < FLAGS.pause + 1:
            time.sleep(0.1)
            now = time.monotonic()
            result["stopped_seconds"] = max(result["stopped_seconds"], now - last)
            last = now
    start = time.monotonic()
    try:
        fit(model, 3)
        result["second_fit"] = "trained"
    except tf.errors.OpError as error:
        result["second_fit"] = f"{type(error).__name__}: {error}"
    result["second_fit_seconds"] = time.monotonic() - start
    report(result)
    if result["second_fit"] != "trained":
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
