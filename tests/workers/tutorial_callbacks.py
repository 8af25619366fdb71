"""TensorFlow's "Multi-worker training with Keras" tutorial's fit, on
tfscale.Strategy, with Keras's or tfscale's callbacks as their docs show them.

Usage: tutorial_callbacks.py DIR CALLBACK...
  keras_files:   ModelCheckpoint, TensorBoard and CSVLogger writing into DIR
  keras_backup:  keras.callbacks.BackupAndRestore(DIR)
  tfscale_backup: tfscale.callbacks.BackupAndRestore(DIR, save_freq=3)
Environment: TFSCALE_STEP_SECONDS: sleep that long after each step (slows
the run down enough for a test to kill it mid-epoch; numbers unchanged).
Reports the optimizer step after restore, the steps trained and the final
model and optimizer variables.
"""

import os
import sys
import time

import numpy as np
import tensorflow as tf

import keras
import tfscale
from report import report

GLOBAL_BATCH = 16
EPOCHS = 2
STEPS_PER_EPOCH = 8


def mnist_like_dataset():
    # The tutorial's pipeline: shuffled, repeated, batched globally; Keras
    # shards it across the workers.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 6, 6)).astype("float32")
    y = rng.integers(0, 4, 256).astype("int64")
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(256, seed=7).repeat().batch(GLOBAL_BATCH))


def build_and_compile():
    model = keras.Sequential([
        keras.Input((6, 6)), keras.layers.Reshape((6, 6, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dropout(0.3), keras.layers.Dense(4)])
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


class Steps(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.first = int(self.model.optimizer.iterations.numpy())
        self.trained = []

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step != (self.trained or [self.first])[-1]:
            self.trained.append(step)
        time.sleep(float(os.environ.get("TFSCALE_STEP_SECONDS", "0")))


def main(directory, kind):
    strategy = tfscale.Strategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_and_compile()
    if kind == "keras_files":
        callbacks = [
            keras.callbacks.ModelCheckpoint(
                os.path.join(directory, "ckpt", "model-{epoch}.keras")),
            keras.callbacks.TensorBoard(os.path.join(directory, "logs")),
            keras.callbacks.CSVLogger(os.path.join(directory, "training.csv")),
        ]
    elif kind == "keras_backup":
        callbacks = [keras.callbacks.BackupAndRestore(backup_dir=directory)]
    else:
        callbacks = [tfscale.callbacks.BackupAndRestore(directory, save_freq=3)]
    steps = Steps()
    model.fit(mnist_like_dataset(), epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
              callbacks=callbacks + [steps], verbose=0)
    report({
        "first_step": steps.first,
        "trained": steps.trained,
        "variables": {v.path: v.numpy().tolist() for v in model.variables},
        "optimizer": {v.path: v.numpy().tolist() for v in model.optimizer.variables},
    })


if __name__ == "__main__":
    main(*sys.argv[1:])
