"""Trains the same tiny model with steps_per_execution=1 and =N in one process.

Flags: --strategy=tfscale|stock (stock: `KerasMultiWorkerMirroredStrategy`),
--steps_per_execution (N). Two inputs, each trained from the same seed with
both settings:
- `distributed`: an infinite tf.data pipeline through
  `distribute_datasets_from_function`, 8 steps an epoch (executions of N steps);
- `numpy`: arrays handed to `fit`, which Keras shards into a finite pipeline
  of 6 batches an epoch (with N=4 the second execution of each epoch runs 2
  steps; each `get_next_as_optional` inside Keras's loop all-reduces whether
  a worker still has data).
Each model is then evaluated on the arrays, with its own steps_per_execution.
Reports each run's trained weights, losses, evaluation and the instance keys
fixed at trace time because the collective sat inside Keras's loop.
"""

import numpy as np
from absl import app
from absl import flags

import keras
import tfscale
import sharded_data
from report import report
from tfscale.strategy import KerasMultiWorkerMirroredStrategy

flags.DEFINE_enum("strategy", "tfscale", ["tfscale", "stock"], "Strategy to use.")
flags.DEFINE_integer("steps_per_execution", 4, "Steps per execution to compare with 1.")
FLAGS = flags.FLAGS

GLOBAL_BATCH = 16
NUM_EXAMPLES = 96


def make_data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(NUM_EXAMPLES, 5)).astype("float32")
    y = rng.integers(0, 3, NUM_EXAMPLES).astype("int64")
    return x, y


def dataset_fn(input_context):
    x, y = make_data()
    return sharded_data.round_robin(x, y, input_context, GLOBAL_BATCH)


def train(strategy, steps_per_execution, data):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                                  keras.layers.ReLU(), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
    if data == "distributed":
        history = model.fit(strategy.distribute_datasets_from_function(dataset_fn),
                            epochs=2, steps_per_epoch=8, verbose=0)
    else:
        x, y = make_data()
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False,
                            verbose=0)
    # evaluate runs Keras's same loop (6 batches: executions of 4 and 2).
    x, y = make_data()
    evaluation = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    return {
        "evaluation": evaluation,
        "weights": [v.numpy().ravel().tolist() for v in model.trainable_variables],
        "loss": history.history["loss"],
        "accuracy": history.history["accuracy"],
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def main(argv):
    if FLAGS.strategy == "tfscale":
        strategy = tfscale.Strategy()
    else:
        strategy = KerasMultiWorkerMirroredStrategy()
    results = {}
    for data in ("distributed", "numpy"):
        for steps in (1, FLAGS.steps_per_execution):
            keys_before = len(strategy.loop_instance_keys)
            result = train(strategy, steps, data)
            result["loop_instance_keys"] = strategy.loop_instance_keys[keys_before:]
            results[f"{data}/{steps}"] = result
    report({
        "num_workers": strategy.num_workers,
        "worker_index": strategy.worker_index,
        "results": results,
    })


if __name__ == "__main__":
    app.run(main)
