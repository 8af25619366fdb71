"""Keras `fit` with each all-reduce configuration; reports the final weights.

Each configuration is a `tfscale.Strategy(communication=CommunicationOptions(
...))` of its own, built one after another in this process as a user would.
Each trains a fresh model from the same seed on the same data.

Flags: --local_size, --configs (comma-separated `algorithm[+compression]`;
`default` is algorithm=None), --steps.
"""

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
from report import report
from sharded_data import round_robin

flags.DEFINE_integer("local_size", 2, "Workers per node.")
flags.DEFINE_list("configs", ["ring", "hierarchical", "2d", "hybrid"],
                  "algorithm[+compression] to train with, in order.")
flags.DEFINE_integer("steps", 6, "Training steps per configuration.")
FLAGS = flags.FLAGS

GLOBAL_BATCH = 12  # divisible by 3 and 4 workers
# Gradients, last layer first: 16 + 256 bytes, then 64 + 512 bytes: two
# buckets at 256 bytes; hybrid at 400 bytes sends the first hierarchically
# and the second by ring.
FUSION_BYTES = 256
HYBRID_BYTES = 400


def dataset_fn(input_context):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.integers(0, 4, 96).astype("int64")
    return round_robin(x, y, input_context, GLOBAL_BATCH)


def options(config):
    algorithm, _, compression = config.partition("+")
    algorithm = None if algorithm == "default" else algorithm
    return tfscale.CommunicationOptions(
        algorithm=algorithm, fusion_threshold_bytes=FUSION_BYTES,
        hybrid_threshold_bytes=HYBRID_BYTES if algorithm == "hybrid" else None,
        local_size=FLAGS.local_size, compression=compression or None,
        timeout_seconds=60)


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(4),
    ])


def train(strategy):
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    data = strategy.distribute_datasets_from_function(dataset_fn)
    history = model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0)
    return {
        "weights": [v.numpy().ravel().tolist() for v in model.trainable_variables],
        "loss": history.history["loss"],
        "accuracy": history.history["accuracy"],
    }


def main(argv):
    results, plans, batch_sizes, algorithms, autotune = {}, {}, {}, {}, {}
    for config in FLAGS.configs:
        strategy = tfscale.Strategy(communication=options(config))
        results[config] = train(strategy)
        plans[config] = [b.algorithm for b in strategy.all_reduce_plan(
            [tf.zeros([8, 16]), tf.zeros([16]), tf.zeros([16, 4]), tf.zeros([4])])]
        batch_sizes[config] = strategy.all_reduce_batch_sizes
        algorithms[config] = strategy.communication_algorithm
        if strategy.autotune is not None:
            autotune[config] = list(strategy.autotune.choices().values())
    report({
        "worker_index": strategy.worker_index,
        "initial": [v.numpy().ravel().tolist()
                    for v in build_model().trainable_variables],
        "nodes": [list(n) for n in strategy.topology.nodes],
        "results": results,
        "plans": plans,
        "all_reduce_batch_sizes": batch_sizes,
        "algorithms": algorithms,
        "autotune": autotune,
    })


if __name__ == "__main__":
    app.run(main)
