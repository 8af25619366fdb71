"""Builds three strategies one after another in one process and trains under each.

1. `KerasMultiWorkerMirroredStrategy(time_all_reduces=True)`: TensorFlow's own
   all-reduce, timed.
2. `tfscale.Strategy()` on the same model and data.
3. `tfscale.Strategy(CommunicationOptions(time_all_reduces=False))` on a model
   of other shapes (a second Strategy reusing the first one's collective keys
   fails with "Shape mismatch in the collective instance").
4. `tfscale.Strategy(CommunicationOptions(timeout_seconds=1))`, built while
   worker 1 is still busy for `LATE_PEER_SECONDS`: a later strategy's start
   barrier waits for a peer still in its last `fit`, however short the
   collective timeout.
"""

import time

import numpy as np

import keras
import tfscale
from report import report
from report import worker_index
from sharded_data import round_robin
from tfscale.strategy import KerasMultiWorkerMirroredStrategy

GLOBAL_BATCH = 8
LATE_PEER_SECONDS = 4


def dataset_fn(input_context):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.integers(0, 3, 64).astype("int64")
    return round_robin(x, y, input_context, GLOBAL_BATCH)


def train(strategy, units):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(units),
                                  keras.layers.ReLU(), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = strategy.distribute_datasets_from_function(dataset_fn)
    model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
    return [v.numpy().ravel().tolist() for v in model.trainable_variables]


def exposed(strategy):
    variable = strategy.exposed_communication_seconds
    return None if variable is None else float(variable.numpy())


def main():
    stock = KerasMultiWorkerMirroredStrategy(time_all_reduces=True)
    stock_weights = train(stock, units=4)
    default = tfscale.Strategy()
    default_weights = train(default, units=4)
    untimed = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm="ring", time_all_reduces=False))
    untimed_weights = train(untimed, units=7)
    if worker_index() == 1:
        time.sleep(LATE_PEER_SECONDS)  # as if a longer fit were still running
    started = time.monotonic()
    tfscale.Strategy(communication=tfscale.CommunicationOptions(timeout_seconds=1))
    report({
        "late_peer_wait_seconds": time.monotonic() - started,
        "stock": {"weights": stock_weights, "exposed": exposed(stock)},
        "default": {"weights": default_weights, "exposed": exposed(default),
                    "batch_sizes": default.all_reduce_batch_sizes},
        "untimed": {"weights": untimed_weights, "exposed": exposed(untimed)},
    })


if __name__ == "__main__":
    main()
