"""`Throughput`: images per second over all workers, per epoch."""

import time

import keras


class Throughput(keras.callbacks.Callback):
    """Adds `images_per_second` (over all workers) to each epoch's logs.

    Measured from the first batch's end to the epoch's end, so graph building
    and the first step's warm-up are left out.

    Args:
        global_batch_size: examples per step over all workers.
    """

    def __init__(self, global_batch_size):
        super().__init__()
        self.global_batch_size = global_batch_size

    def on_epoch_begin(self, epoch, logs=None):
        self._start = None
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        if self._start is None:
            self._start = time.perf_counter()
        else:
            self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._steps:
            elapsed = time.perf_counter() - self._start
            logs["images_per_second"] = self._steps * self.global_batch_size / elapsed
