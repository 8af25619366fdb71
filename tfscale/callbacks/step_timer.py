"""`StepTimer`: the wall time, and exposed communication, of every step."""

import time

import keras


class StepTimer(keras.callbacks.Callback):
    """Records each training step's wall time, for benchmarks.

    After `fit`, `step_seconds` holds one entry per step (per call when
    `steps_per_execution` > 1). Given a strategy whose all-reduces are timed
    (`Strategy.exposed_communication_seconds` is not `None`),
    `exposed_communication_seconds` holds each step's wait on all-reduces.

    Args:
        strategy: `None`, or the `tfscale.Strategy` (or
            `KerasMultiWorkerMirroredStrategy`) the model trains under.
    """

    def __init__(self, strategy=None):
        super().__init__()
        self._exposed = None
        if strategy is not None:
            self._exposed = strategy.exposed_communication_seconds
        self.step_seconds = []
        self.exposed_communication_seconds = []

    def on_train_begin(self, logs=None):
        self.step_seconds = []
        self.exposed_communication_seconds = []

    def on_train_batch_begin(self, batch, logs=None):
        if self._exposed is not None:
            self._exposed_before = self._exposed.numpy()
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.step_seconds.append(time.perf_counter() - self._start)
        if self._exposed is not None:
            self.exposed_communication_seconds.append(
                float(self._exposed.numpy() - self._exposed_before))
