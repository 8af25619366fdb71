"""`TrainingCheckpoint`: checkpoints of the whole training state, chief only."""

import keras

from tfscale import checkpoint
from tfscale.callbacks.chief_backup import ChiefBackup


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
    """

    def __init__(self, directory, strategy, save_steps, record=None):
        super().__init__()
        self.directory = directory
        self.strategy = strategy
        self.save_steps = save_steps
        self.record = record
        self._backup = None

    def _save(self):
        if self._backup is None:  # kept across fits: one model, one graph
            self._backup = ChiefBackup(self.model, self.strategy, self.directory)
        self._backup.save(extra=self.record(checkpoint.step(self.model))
                          if self.record else None)

    def on_train_batch_end(self, batch, logs=None):
        if checkpoint.step(self.model) % self.save_steps == 0:
            self._save()

    def on_train_end(self, logs=None):
        self._save()
