"""Keras `fit` under `algorithm="auto"` (2 nodes of 2), against the ring.

One training of the same model from the same seed per scenario
(`--scenario`):
- `ring`: the ring, for reference;
- `default`: the default algorithm (None: auto on these 2 nodes) with
  `autotune_dir` (trials, then the choice, stored by the chief), 3 steps
  per execution: 8 executions (24 steps) try both fusion thresholds and
  decide, then Keras traces its train function again and the 9th runs the
  choice as a fixed plan;
- `restarted`: `algorithm="auto"` with the same directory, as a restarted
  job (the chief finds the choice: no trials), backed up;
- `default+powersgd`: the default with PowerSGD;
- `custom_loop`: "auto" in a custom training loop;
- `chief_wrapped`: the default under a callback that wraps the train
  function on the chief only.
Reports the training's weights, its autotuner's state and what the chief
stored.

Flags: --scenario, --autotune_dir, --steps.
"""

import json
import os

import numpy as np
from absl import app
from absl import flags

import keras
import tensorflow as tf
import tfscale
from tfscale import checkpoint
from tfscale.collectives import autotune
from report import report
from report import worker_index
from sharded_data import round_robin

SCENARIOS = ("ring", "default", "restarted", "default+powersgd", "custom_loop",
             "chief_wrapped")
flags.DEFINE_enum("scenario", None, SCENARIOS, "The training to run.")
flags.DEFINE_string("autotune_dir", None, "Where the chief stores the choice.")
flags.DEFINE_integer("steps", 27, "Training steps per training (the default's "
                     "first: its trials and decision, then its choice).")
FLAGS = flags.FLAGS

GLOBAL_BATCH = 12
# The gradients, last layer first, take 16, 256, 64 and 512 bytes: one
# bucket at 1024 bytes, two at a quarter of it (auto tries both).
FUSION_BYTES = 1024


def dataset_fn(input_context):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(240, 8)).astype("float32")
    y = rng.integers(0, 4, 240).astype("int64")
    return round_robin(x, y, input_context, GLOBAL_BATCH)


def train(algorithm, autotune_dir=None, steps_per_execution=1, powersgd=None,
          steps=None, fusion_bytes=FUSION_BYTES, callbacks=()):
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm=algorithm, fusion_threshold_bytes=fusion_bytes, local_size=2,
        timeout_seconds=60, autotune_dir=autotune_dir,
        compression=powersgd and "powersgd", powersgd=powersgd))
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
    model.fit(data, epochs=1, steps_per_epoch=steps or FLAGS.steps, verbose=0,
              callbacks=list(callbacks))
    result = {"weights": [v.numpy().ravel().tolist() for v in model.trainable_variables],
              "algorithm": strategy.communication_algorithm}
    if strategy.autotune is not None:
        result["autotune"] = list(strategy.autotune.choices().values())
    return strategy, result


class WrapOnChief(keras.callbacks.Callback):
    """Wraps `model.train_function` on the chief only, as a callback given
    on the chief alone may: no worker may then trace it again."""

    def on_train_begin(self, logs=None):
        if self.model.distribute_strategy.worker_index == 0:
            keras_function = self.model.train_function
            self.model.train_function = lambda iterator: keras_function(iterator)


def custom_loop(steps):
    """TensorFlow's custom-training-loop tutorial under algorithm="auto",
    its `tf.function` built anew when `strategy.autotune.retrace_due()` (as
    docs/communication.md tells such a loop to)."""
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm="auto", fusion_threshold_bytes=FUSION_BYTES, local_size=2,
        timeout_seconds=60))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)])
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum")
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    data = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def step_fn(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True)) / GLOBAL_BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    def build():
        return tf.function(lambda inputs: strategy.run(step_fn, args=(inputs,)))

    train_step, built_anew = build(), []
    for step in range(steps):
        train_step(next(data))
        if strategy.autotune.retrace_due():
            train_step = build()
            built_anew.append(step)
    return {"weights": [v.numpy().ravel().tolist() for v in model.trainable_variables],
            "autotune": list(strategy.autotune.choices().values()),
            "built_anew": built_anew, "algorithm": strategy.communication_algorithm}


def run(scenario):
    """The training of `scenario`: (its result, what the chief stored)."""
    if scenario == "ring":
        return train("ring")[1], None
    if scenario == "default":
        # 3 steps per execution: the trials and the decision run inside
        # Keras's loop (a tf.while_loop) too.
        _, result = train(None, FLAGS.autotune_dir, steps_per_execution=3)
        path = os.path.join(FLAGS.autotune_dir, autotune.FILE_NAME)
        if not os.path.exists(path):
            return result, None
        with open(path) as f:
            return result, json.load(f)
    if scenario == "restarted":
        # Backed up as a user would: its train function, built anew once the
        # stored choice is agreed, goes under the callback's wrapper.
        backup_dir = os.path.join(FLAGS.autotune_dir, "backup")
        _, result = train("auto", FLAGS.autotune_dir, callbacks=[
            tfscale.callbacks.BackupAndRestore(backup_dir, save_freq=10,
                                               delete_checkpoint=False)])
        result["backup"] = checkpoint.state(backup_dir)
        return result, None
    if scenario == "default+powersgd":
        # PowerSGD (rank 1 compresses both kernels) from step 2: its factors'
        # all-reduces are tuned too, each its own call site (a bucket per
        # tensor, one threshold: 9 candidate trials and 2 of the mix, so 12
        # compressed steps decide, at step 13), and traced again after them
        # although the uncompressed steps' all-reduce never chose (its branch
        # ran twice): the last 2 of 16 steps run the choice as a fixed plan.
        return train(None, powersgd=tfscale.PowerSGDOptions(rank=1, start_step=2),
                     steps=16, fusion_bytes=0)[1], None
    if scenario == "custom_loop":
        return custom_loop(FLAGS.steps), None
    return train(None, steps=25, callbacks=[WrapOnChief()])[1], None


def main(argv):
    result, stored = run(FLAGS.scenario)
    report({"worker_index": worker_index(), "result": result,
            "stored": stored})


if __name__ == "__main__":
    app.run(main)
