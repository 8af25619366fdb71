"""`BackupAndRestore`: Keras's callback of that name, safe with N workers and
resuming at the saved step."""

import os
import shutil

import keras

from tfscale._private import keras_hooks
from tfscale import checkpoint
from tfscale._validation import is_int
from tfscale.callbacks.chief_backup import ChiefBackup
from tfscale.callbacks.preemption_stop import PreemptionStop


class BackupAndRestore(keras.callbacks.Callback):
    """`keras.callbacks.BackupAndRestore` for `tfscale.Strategy`: same
    arguments, one backup for all workers, and a resume at the saved step.

    At the start of `fit`, every worker restores the newest backup in
    `backup_dir` (weights, BatchNorm statistics, optimizer state and
    Dropout's random state, with `tfscale.checkpoint`) and the fit continues
    at the epoch and batch it was saved at. The batches the interrupted run
    had already trained on are read from the input and left out, so with an
    input that yields the same batches each time it is iterated from the
    start, the resumed fit ends with the same weights, bit for bit, as one
    never interrupted: a seeded `shuffle(...).repeat()` with
    `steps_per_epoch` (TensorFlow's tutorial), or, for a dataset Keras
    iterates anew each epoch, `shuffle(..., reshuffle_each_iteration=False)`. Keras's own callback
    restarts the saved epoch from its first batch, and with two or more
    workers every worker writes the same file.

    Every worker must use it (BatchNorm statistics are averaged across
    workers before each backup, a collective); only the chief writes,
    atomically. A backup is written when the first step after its batch or
    epoch end starts, where the input's position is known: after the last
    epoch nothing is written unless `delete_checkpoint=False`.

    Under `fit`, the logged metrics of the epoch a run resumes in average
    only the batches trained after the resume.

    Args:
        backup_dir: where backups go; on a cluster, storage every worker can
            read. Used by this callback alone.
        save_freq: `"epoch"`: back up at the end of every epoch; an integer
            `n`: every `n` batches (steps).
        delete_checkpoint: delete `backup_dir` when `fit` ends (a fit that
            ends because of an error or a preemption keeps it).
        save_before_preemption: on a SIGTERM to any worker, every worker
            backs up the step after it and raises
            `tfscale.preemption.Preempted` (exit code 143; Keras 2's argument
            of this name, dropped by Keras 3; see `tfscale.preemption`). A
            relaunched fit resumes at that step.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True,
                 save_before_preemption=True):
        super().__init__()
        if not backup_dir:
            raise ValueError(
                "Argument `backup_dir` must be a directory path. "
                f"Received: backup_dir={backup_dir!r}"
            )
        if save_freq != "epoch" and (not is_int(save_freq) or save_freq < 1):
            raise ValueError(
                "Argument `save_freq` must be 'epoch' or an integer >= 1 "
                f"(batches between backups). Received: save_freq={save_freq!r}"
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        # Keras's train function, which `_train_function` wraps (where Keras
        # must trace it again, the new one goes here: keras_hooks.retrace_train_function).
        self.wrapped_train_function = None
        self._preemption = None

    def _strategy(self):
        return self.model.distribute_strategy

    def _is_chief(self):
        return getattr(self._strategy(), "is_chief", True)

    def on_train_begin(self, logs=None):
        model = self.model
        if model.optimizer is None:
            raise ValueError(
                "tfscale.callbacks.BackupAndRestore needs a compiled model: "
                "call `model.compile(...)` before `fit`.")
        self._epoch = 0  # the epoch under way
        self._batch = 0  # calls of the train function made in this epoch
        self._due = False
        self._iterator = None
        self._position = 0  # batches read from `_iterator`
        self._skip_batches = 0  # calls of the resumed epoch left out
        self._skip_reads = 0  # batches to read from the first iterator
        # The newest checkpoint that reads back whole (corrupt ones moved aside).
        checkpoint.recover(self.backup_dir, self._is_chief())
        saved = checkpoint.state(self.backup_dir)
        if saved is not None and "position" not in saved:
            raise ValueError(
                f"Argument `backup_dir` holds checkpoints that "
                "tfscale.callbacks.BackupAndRestore did not write (they do not "
                "say where in the input to resume); give it a directory of its "
                f"own. Received: backup_dir={self.backup_dir!r}")
        self._check_backup_within_fit(saved)
        with self._strategy().scope():
            step = checkpoint.restore(model, self.backup_dir)
        self._backup = ChiefBackup(
            model, self._strategy(), self.backup_dir, last_saved=step)
        if saved is not None:
            self._epoch = saved["epoch"]
            self._skip_batches = saved["batch"]
            self._skip_reads = self._position = saved["position"]
            keras_hooks.set_initial_epoch(model, saved["epoch"])
        self.wrapped_train_function = model.train_function
        model.train_function = self._train_function
        if self.save_before_preemption:
            self._preemption = PreemptionStop(model, self._save)
            self._preemption.begin()

    def _check_backup_within_fit(self, saved):
        # A backup from past this fit's end (a later fit of the same
        # training, e.g. a batch schedule's next phase) would be restored
        # and then deleted by a fit that trains nothing.
        epochs = self.params.get("epochs")
        if saved is None or epochs is None:
            return
        if saved["epoch"] > epochs or (saved["epoch"] == epochs and saved["batch"]):
            raise ValueError(
                f"Argument `backup_dir` holds a backup saved at epoch "
                f"{saved['epoch']} (batch {saved['batch']}), past the end of "
                f"this fit (epochs={epochs}): one BackupAndRestore serves one "
                "fit. For training in several fits (the phases of "
                "tfscale.batch_growth), restore with "
                "tfscale.checkpoint.restore and save with "
                "tfscale.callbacks.TrainingCheckpoint, as tfscale-train does. "
                f"Received: backup_dir={self.backup_dir!r}")

    def _train_function(self, iterator):
        if iterator is not self._iterator:
            if self._skip_reads:
                # The interrupted run had read these batches from an iterator
                # that started where this one starts: read past them.
                for _ in range(self._skip_reads):
                    next(iterator)
                self._skip_reads = 0
            else:
                self._position = self._batch * self.model.steps_per_execution
            self._iterator = iterator
        if self._batch < self._skip_batches:
            self._batch += 1
            return {}
        if self._due:
            self._save()
        logs = self.wrapped_train_function(iterator)
        self._batch += 1
        self._position += self.model.steps_per_execution
        return logs

    def _save(self):
        self._due = False
        self._backup.save(extra={
            "epoch": self._epoch, "batch": self._batch, "position": self._position})

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._skip_batches = 0
        self._epoch = epoch
        self._batch = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._preemption:
            self._preemption.before_batch()

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq != "epoch" and (
            checkpoint.step(self.model) - self._backup.last_saved >= self.save_freq
        ):
            self._due = True
        if self._preemption:
            self._preemption.after_batch()

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._due = True

    def on_train_end(self, logs=None):
        model = self.model
        model.train_function = self.wrapped_train_function
        keras_hooks.set_initial_epoch(model, None)
        if self._preemption:
            # A SIGTERM in the last step: the fit is done, but the script
            # after it would not be; a relaunch resumes at the end.
            self._preemption.at_end(save=self._save_at_end)
        if self.delete_checkpoint:
            if self._is_chief():
                shutil.rmtree(self.backup_dir, ignore_errors=True)
            return
        self._save_at_end()

    def _save_at_end(self):
        self._epoch += 1 if self._batch else 0
        self._batch = self._position = 0
        self._save()
