"""A small fit under tfscale.Strategy in which one worker goes wrong:

- `stop`: worker 1 stops itself (SIGSTOP) before batch 3, as a hung process;
- `extra_step`: worker 0 runs one step more than the others;
- `frozen_layer`: worker 1 freezes the last layer (`trainable = False`), so
  its gradient buckets are not worker 0's;
- `other_model`: worker 1 builds its first layer with 17 units, not 16.

The collective timeout is short; the flight recorder reports where each
worker is (tfscale.collectives.flight_recorder).
"""

import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf

import tfscale
from report import worker_index

STEPS = 4


class StopBeforeBatch3(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3 and worker_index() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)


def main(scenario):
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        timeout_seconds=10, fusion_threshold_bytes=0, algorithm="ring"))
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with strategy.scope():
        units = 17 if scenario == "other_model" and worker_index() == 1 else 16
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(units),
                                  keras.layers.Dense(2)])
        if scenario == "frozen_layer" and worker_index() == 1:
            model.layers[-1].trainable = False
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    steps = STEPS + (1 if scenario == "extra_step" and worker_index() == 0 else 0)
    callbacks = [StopBeforeBatch3()] if scenario == "stop" else []
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)


if __name__ == "__main__":
    main(sys.argv[1])
