"""`TensorBoardScalars`: per-step scalars of a multi-worker run."""

import time

import keras
import tensorflow as tf


class TensorBoardScalars(keras.callbacks.Callback):
    """Writes per-step scalars for TensorBoard; use it on the chief only.

    Scalars: `images_per_second` (over all workers, from the time between
    consecutive steps), `learning_rate` (the schedule's value at the step),
    `loss_scale` (under dynamic loss scaling), `loss` (the epoch's running
    mean, averaged over workers, as Keras reports it) and, given a
    `tfscale.Strategy`, `exposed_communication_seconds` (this worker's wait
    on all-reduces in the step: see `Strategy.exposed_communication_seconds`).

    Args:
        log_dir: where the event files go.
        global_batch_size: examples per step over all workers.
        strategy: `None`, or the `tfscale.Strategy` the model trains under.
    """

    def __init__(self, log_dir, global_batch_size, strategy=None):
        super().__init__()
        self.log_dir = log_dir
        self.global_batch_size = global_batch_size
        self._exposed = None
        if strategy is not None:
            self._exposed = strategy.exposed_communication_seconds
        self._writer = None
        self._last = None
        self._exposed_before = None

    def on_train_begin(self, logs=None):
        self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._last = None  # validation and epoch ends are not step time

    def on_train_batch_begin(self, batch, logs=None):
        if self._exposed is not None:
            self._exposed_before = (
                self._exposed.numpy(), int(self.model.optimizer.iterations.numpy())
            )

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        optimizer = self.model.optimizer
        step = int(optimizer.iterations.numpy())
        with self._writer.as_default(step=step):
            if self._exposed is not None:
                # Per step, also when one call runs several (steps_per_execution).
                seconds, step_before = self._exposed_before
                tf.summary.scalar(
                    "exposed_communication_seconds",
                    (self._exposed.numpy() - seconds) / max(step - step_before, 1),
                )
            if self._last is not None:
                tf.summary.scalar(
                    "images_per_second", self.global_batch_size / (now - self._last)
                )
            # Keras evaluates a schedule at the current step here.
            tf.summary.scalar(
                "learning_rate", float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            )
            scale = getattr(optimizer, "dynamic_scale", None)
            if scale is not None:
                tf.summary.scalar("loss_scale", float(scale.numpy()))
            if logs and "loss" in logs:
                tf.summary.scalar("loss", float(logs["loss"]))
        self._last = now

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
