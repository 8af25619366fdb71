"""`BackupAndResume`: checkpoints of the whole training state, chief only."""

import keras

from tfscale import checkpoint
from tfscale.callbacks.sync_batch_norm_statistics import batch_norm_synchronizer


class BackupAndResume(keras.callbacks.Callback):
    """Saves the training state every `save_steps` steps and at the end.

    Every worker must use it (BatchNorm statistics are averaged across
    workers before each save, a collective); only the chief writes.

    Args:
        directory: where checkpoints go; on a cluster, storage every worker
            can read (a resumed worker restores from it).
        strategy: the `tfscale.Strategy`.
        save_steps: steps between checkpoints.
    """

    def __init__(self, directory, strategy, save_steps):
        super().__init__()
        self.directory = directory
        self.strategy = strategy
        self.save_steps = save_steps
        self._sync = None
        self._last_saved = None

    def _save(self):
        step = checkpoint.step(self.model)
        if step == self._last_saved:
            return
        if self._sync is None:
            self._sync = batch_norm_synchronizer(self.model, self.strategy)
        self._sync()
        if self.strategy.is_chief:
            checkpoint.save(self.model, self.directory, step)
        self._last_saved = step

    def on_train_batch_end(self, batch, logs=None):
        if checkpoint.step(self.model) % self.save_steps == 0:
            self._save()

    def on_train_end(self, logs=None):
        self._save()
