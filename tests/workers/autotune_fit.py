"""Keras `fit` under `algorithm="auto"` (2 nodes of 2), against the ring.

Three trainings of the same model from the same seed, one strategy each,
built one after another as a user would: `ring`; `auto` with
`autotune_dir` (trials, then the choice, stored by the chief); `auto`
again with the same directory, as a restarted job (the chief finds the
choice: no trials). The first `auto` runs 3 steps per execution. Reports each one's weights, its autotuner's state and
what the chief stored.

Flags: --autotune_dir, --steps.
"""

import json
import os

import numpy as np
from absl import app
from absl import flags

import keras
import tfscale
from tfscale.collectives import autotune
from report import report
from sharded_data import round_robin

flags.DEFINE_string("autotune_dir", None, "Where the chief stores the choice.")
flags.DEFINE_integer("steps", 12, "Training steps per training.")
FLAGS = flags.FLAGS

GLOBAL_BATCH = 12
# A bucket per gradient: 4 buckets, each tuned.
FUSION_BYTES = 0


def dataset_fn(input_context):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(240, 8)).astype("float32")
    y = rng.integers(0, 4, 240).astype("int64")
    return round_robin(x, y, input_context, GLOBAL_BATCH)


def train(algorithm, autotune_dir=None, steps_per_execution=1):
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm=algorithm, fusion_threshold_bytes=FUSION_BYTES, local_size=2,
        timeout_seconds=60, autotune_dir=autotune_dir))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(4),
        ])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution)
    data = strategy.distribute_datasets_from_function(dataset_fn)
    model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0)
    result = {"weights": [v.numpy().ravel().tolist() for v in model.trainable_variables]}
    if strategy.autotune is not None:
        result["autotune"] = list(strategy.autotune.choices().values())
    return strategy, result


def main(argv):
    results = {}
    strategy, results["ring"] = train("ring")
    # 3 steps per execution: the trials and the decision run inside Keras's
    # loop (a tf.while_loop) too.
    _, results["auto"] = train("auto", FLAGS.autotune_dir, steps_per_execution=3)
    path = os.path.join(FLAGS.autotune_dir, autotune.FILE_NAME)
    stored = None
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
    _, results["restarted"] = train("auto", FLAGS.autotune_dir)
    report({"worker_index": strategy.worker_index, "results": results,
            "stored": stored})


if __name__ == "__main__":
    app.run(main)
