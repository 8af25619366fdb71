"""`TrainingCheckpoint`: checkpoints of the whole training state, chief only."""

import keras

from tfscale import checkpoint
from tfscale.callbacks.chief_backup import ChiefBackup
from tfscale.callbacks.preemption_stop import PreemptionStop


class TrainingCheckpoint(keras.callbacks.Callback):
    """Saves the training state every `save_steps` steps and at the end.

    Every worker must use it (BatchNorm statistics are averaged across
    workers before each save, a collective); only the chief writes.

    Args:
        directory: where checkpoints go; on a cluster, storage every worker
            can read (a resumed worker restores from it).
        strategy: the `tfscale.Strategy`.
        save_steps: steps between checkpoints.
        record: optional function of the step returning a JSON-able dict
            saved with each checkpoint (`tfscale.checkpoint.state` reads
            it), e.g. `tfscale.batch_growth.phase_record`'s phase.
        save_before_preemption: on a SIGTERM to any worker, every worker
            saves the step after it and raises
            `tfscale.preemption.Preempted` (exit code 143), as
            `tf.keras.callbacks.BackupAndRestore(save_before_preemption=True)`
            did in Keras 2 (`tfscale.preemption`).
    """

    def __init__(self, directory, strategy, save_steps, record=None,
                 save_before_preemption=True):
        super().__init__()
        self.directory = directory
        self.strategy = strategy
        self.save_steps = save_steps
        self.record = record
        self.save_before_preemption = save_before_preemption
        self._backup = None
        self._preemption = None

    def _save(self):
        if self._backup is None:  # kept across fits: one model, one graph
            self._backup = ChiefBackup(self.model, self.strategy, self.directory)
        self._backup.save(extra=self.record(checkpoint.step(self.model))
                          if self.record else None)

    def on_train_begin(self, logs=None):
        if self.save_before_preemption and self._preemption is None:
            self._preemption = PreemptionStop(self.model, self._save)
        if self._preemption:
            self._preemption.begin()

    def on_train_batch_begin(self, batch, logs=None):
        if self._preemption:
            self._preemption.before_batch()

    def on_train_batch_end(self, batch, logs=None):
        if checkpoint.step(self.model) % self.save_steps == 0:
            self._save()
        if self._preemption:
            self._preemption.after_batch()

    def on_train_end(self, logs=None):
        self._save()
        if self._preemption:
            self._preemption.at_end()
