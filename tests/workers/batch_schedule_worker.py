"""Trains a tiny digits classifier under a batch schedule, the Python way.

What a Python user writes (tfscale.batch_growth's docstring): the phases
of `tfscale.recipes.Settings(batch_schedule=...)`, one fit per
`fit_parts(...)` part, each on `tfscale.data.digits` at its phase's batch
from its phase's first example, checkpoints with `TrainingCheckpoint` recording
the phase, and a restart restoring the newest one.

Flags: --model_dir (checkpoints; resumes from them), --kill_at_step (the
process kills itself with SIGKILL right after the checkpoint of that step
is written; 0: never), --straight_dir (before training in --model_dir, train
from scratch in this directory without stopping, in the same process).
Reports per training the final weights, the optimizer's updates, the
per-worker batch of each fit and the checkpoint's phase record.
"""

import os
import signal
import time

import numpy as np
from absl import app
from absl import flags

import keras
import tfscale
from report import report

flags.DEFINE_string("model_dir", None, "Checkpoints; resumes from them.")
flags.DEFINE_integer("kill_at_step", 0, "SIGKILL after this step's checkpoint.")
flags.DEFINE_string("straight_dir", None, "Then train uninterrupted here.")
FLAGS = flags.FLAGS

SETTINGS = tfscale.recipes.Settings(
    learning_rate=0.1, batch_schedule="1:2,2:2", max_global_batch_size=32)
GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 4  # of the first phase: 64 examples per epoch
EPOCHS = 3


class KillAtStep(keras.callbacks.Callback):
    """Kills this process (SIGKILL: no cleanup) after step `step`, once the
    checkpoint callbacks before it in the list have run and the chief's
    checkpoint of that step is on disk: another worker's save returns before
    the chief's write ends, and the launcher stops the chief as soon as that
    worker dies."""

    def __init__(self, step, model_dir):
        super().__init__()
        self.step = step
        self.model_dir = model_dir

    def on_train_batch_end(self, batch, logs=None):
        if tfscale.checkpoint.step(self.model) != self.step:
            return
        deadline = time.monotonic() + 60
        while (tfscale.checkpoint.latest(self.model_dir)[0] != self.step
               and time.monotonic() < deadline):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def train(strategy, model_dir, kill_at_step=0):
    keras.utils.set_random_seed(0)
    phases = tfscale.recipes.batch_phases(SETTINGS, GLOBAL_BATCH,
                                          STEPS_PER_EPOCH, EPOCHS)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
        optimizer, _ = tfscale.recipes.make_optimizer(
            SETTINGS, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS)
        model.compile(optimizer=optimizer, loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
        tfscale.batch_growth.check_record(
            phases, tfscale.checkpoint.state(model_dir))
        start_step = tfscale.checkpoint.restore(model, model_dir)
    callbacks = [tfscale.callbacks.TrainingCheckpoint(
        model_dir, strategy, 1,
        record=lambda step: tfscale.batch_growth.phase_record(phases, step))]
    if kill_at_step:
        callbacks.append(KillAtStep(kill_at_step, model_dir))
    fits = []
    for part in tfscale.batch_growth.fit_parts(phases, start_step):
        fit = {"epochs": [part.initial_epoch, part.epochs],
               "steps_per_epoch": part.steps_per_epoch}

        def make(context, phase=part.phase, data_step=part.data_step, fit=fit):
            dataset = tfscale.data.digits(
                "train", phase.global_batch_size, image_size=8, seed=3,
                input_context=context, start_step=data_step,
                start_example=phase.first_example)
            fit["batch_per_worker"] = int(dataset.element_spec[0].shape[0])
            return dataset
        dataset = strategy.distribute_datasets_from_function(make)
        fits.append(fit)
        model.fit(dataset, initial_epoch=part.initial_epoch, epochs=part.epochs,
                  steps_per_epoch=part.steps_per_epoch, callbacks=callbacks,
                  verbose=0)
    return {
        "start_step": start_step,
        "fits": fits,
        "updates": int(model.optimizer.iterations.numpy()),
        "learning_rate": float(keras.ops.convert_to_numpy(
            model.optimizer.learning_rate)),
        "record": {k: v for k, v in tfscale.checkpoint.state(model_dir).items()
                   if k != "checkpoint"},
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
    }


def main(argv):
    del argv
    strategy = tfscale.Strategy()
    result = {}
    if FLAGS.straight_dir:  # first: the same initial weights as a killed run's
        result["straight"] = train(strategy, FLAGS.straight_dir)
    result["resumed"] = train(strategy, FLAGS.model_dir, FLAGS.kill_at_step)
    report(result)


if __name__ == "__main__":
    app.run(main)
