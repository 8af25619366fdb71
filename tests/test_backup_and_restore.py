"""tfscale.callbacks.BackupAndRestore in one process: a fit interrupted
mid-epoch and run again resumes at the saved step and ends with the weights
of a fit never interrupted (the 2-worker kill test is in
tests/reliability/test_backup_and_restore_killed.py)."""

import json
import os
import signal
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from multiworker import WORKERS_DIR
from tfscale import callbacks
from tfscale import checkpoint
from tfscale import preemption
from tfscale._private import keras_hooks

sys.path.insert(0, WORKERS_DIR)
from tutorial_callbacks import Steps  # noqa: E402  (the optimizer step trained)

STEPS_PER_EPOCH = 5
EPOCHS = 3


class Interrupt(keras.callbacks.Callback):
    def __init__(self, at_step):
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.at_step:
            raise KeyboardInterrupt  # what a killed process never gets past


def model_and_data(per_epoch_iterator):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    x = np.random.RandomState(1).normal(size=(40, 4)).astype("float32")
    y = np.random.RandomState(2).normal(size=(40, 2)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if per_epoch_iterator:
        # Keras starts a new iterator every epoch; a resumed process starts
        # its count of them again, so each must shuffle the same way.
        dataset = dataset.shuffle(40, seed=3, reshuffle_each_iteration=False)
        return model, dataset.batch(8), None
    dataset = dataset.shuffle(40, seed=3)
    # one iterator through all epochs, as TensorFlow's tutorial does
    return model, dataset.repeat().batch(8), STEPS_PER_EPOCH


def run(backup_dir, per_epoch_iterator, extra=(), **kwargs):
    model, dataset, steps = model_and_data(per_epoch_iterator)
    model.fit(dataset, epochs=EPOCHS, steps_per_epoch=steps, verbose=0,
              callbacks=[callbacks.BackupAndRestore(backup_dir, **kwargs), *extra])
    return model


@pytest.mark.parametrize("per_epoch_iterator", [False, True])
@pytest.mark.parametrize("save_freq,interrupt_at,resumed_at", [
    (3, 8, 6),  # mid-epoch 1 (steps 5-9)
    ("epoch", 13, 10),  # the backup of epoch 1's end
])
def test_resumes_at_the_saved_step(tmp_path, per_epoch_iterator, save_freq,
                                   interrupt_at, resumed_at):
    straight = run(tmp_path / "straight", per_epoch_iterator, save_freq=save_freq)
    assert not (tmp_path / "straight").exists()  # delete_checkpoint=True

    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        run(backup, per_epoch_iterator, [Interrupt(interrupt_at)], save_freq=save_freq)
    state = json.loads((backup / "state.json").read_text())
    assert state["step"] == resumed_at
    steps = Steps()
    resumed = run(backup, per_epoch_iterator, [steps], save_freq=save_freq)

    assert steps.first == resumed_at
    assert steps.trained == list(range(resumed_at + 1, EPOCHS * STEPS_PER_EPOCH + 1))
    for a, b in zip(straight.variables, resumed.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    for a, b in zip(straight.optimizer.variables, resumed.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


class BuildAnew(keras.callbacks.Callback):
    """Makes Keras build its train function anew after step `at_step`, as
    tfscale does once algorithm="auto" has made its choice (fit_hooks), and
    keeps what it saw: the train functions before and after."""

    def __init__(self, at_step):
        super().__init__()
        self.at_step = at_step
        self.seen = None

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.at_step:
            before = self.model.train_function
            inner = before.__self__.wrapped_train_function
            built = keras_hooks.can_retrace_train_function(self.model)
            keras_hooks.retrace_train_function(self.model)
            self.seen = dict(built=built, before=before, inner=inner,
                             after=self.model.train_function,
                             inner_after=before.__self__.wrapped_train_function)


def test_a_train_function_built_anew_mid_fit_goes_under_the_backups_wrapper(tmp_path):
    backup = tmp_path / "backup"
    anew = BuildAnew(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(backup, False, [anew, Interrupt(8)], save_freq=3)
    finally:
        preemption.watch_of(None).uninstall()  # the process would have left
    seen = anew.seen
    # The wrapper stayed in place and now calls Keras's new function ...
    assert seen["built"] and seen["after"] == seen["before"]
    assert seen["inner_after"] is not seen["inner"]
    # ... and went on backing up: step 6 was saved after the new one was built.
    assert json.loads((backup / "state.json").read_text())["step"] == 6


def test_only_keras_functions_or_tfscale_wrappers_of_them_are_built_anew(tmp_path):
    model, _, _ = model_and_data(False)
    model.make_train_function()
    keras_function = model.train_function
    assert keras_hooks.can_retrace_train_function(model)
    keras_hooks.retrace_train_function(model)
    assert model.train_function is not keras_function  # Keras's own: built anew
    # A wrapper tfscale does not know, outside or under tfscale's own.
    model.train_function = lambda iterator: keras_function(iterator)
    assert not keras_hooks.can_retrace_train_function(model)
    backup = callbacks.BackupAndRestore(tmp_path / "backup")
    backup.wrapped_train_function = model.train_function
    model.train_function = backup.on_train_end  # any bound method of it
    assert not keras_hooks.can_retrace_train_function(model)
    backup.wrapped_train_function = keras_function
    assert keras_hooks.can_retrace_train_function(model)
    # A test function wrapped by unknown code.
    model.make_test_function()
    test_function = model.test_function
    model.test_function = lambda iterator: test_function(iterator)
    assert not keras_hooks.can_retrace_train_function(model)


class Sigterm(keras.callbacks.Callback):
    """Sends this process SIGTERM after step `at_step`, as an eviction would."""

    def __init__(self, at_step):
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_saves_the_next_step_exits_143_and_the_rerun_resumes_there(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    straight = run(tmp_path / "straight", False, save_freq=1000)
    # A fit gives SIGTERM back when it ends.
    assert signal.getsignal(signal.SIGTERM) is before

    backup = tmp_path / "backup"
    try:
        with pytest.raises(preemption.Preempted) as stopped:
            # Callbacks run in order: the backup sees the SIGTERM one step on.
            run(backup, False, [Sigterm(7)], save_freq=1000)
    finally:
        preemption.watch_of(None).uninstall()  # the process would have left
    assert stopped.value.code == 143 and stopped.value.step == 8
    assert stopped.value.workers == 1
    assert json.loads((backup / "state.json").read_text())["step"] == 8
    steps = Steps()
    resumed = run(backup, False, [steps], save_freq=1000)
    assert steps.first == 8
    assert not backup.exists()  # the resumed fit finished
    for a, b in zip(straight.variables, resumed.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    for a, b in zip(straight.optimizer.variables, resumed.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_a_resumed_run_that_was_not_interrupted_started_from_scratch(tmp_path):
    model = run(tmp_path / "b", False, save_freq=2, delete_checkpoint=False)
    state = json.loads((tmp_path / "b" / "state.json").read_text())
    assert state["step"] == EPOCHS * STEPS_PER_EPOCH and state["epoch"] == EPOCHS
    steps = Steps()
    again = run(tmp_path / "b", False, [steps], save_freq=2, delete_checkpoint=False)
    assert steps.first == EPOCHS * STEPS_PER_EPOCH and steps.trained == []
    for a, b in zip(model.variables, again.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("kwargs,message", [
    (dict(backup_dir=""), r"Argument `backup_dir` must be a directory path\. "
                          r"Received: backup_dir=''"),
    (dict(backup_dir="b", save_freq=0),
     r"Argument `save_freq` must be 'epoch' or an integer >= 1 \(batches between "
     r"backups\)\. Received: save_freq=0"),
    (dict(backup_dir="b", save_freq="batch"), r"Received: save_freq='batch'"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        callbacks.BackupAndRestore(**kwargs)


def test_a_directory_of_other_checkpoints_is_refused(tmp_path):
    model, dataset, steps = model_and_data(False)
    model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
    checkpoint.save(model, tmp_path, step=1)  # as tfscale-train writes them
    with pytest.raises(ValueError, match=(
            r"Argument `backup_dir` holds checkpoints that "
            r"tfscale.callbacks.BackupAndRestore did not write .*"
            rf"Received: backup_dir='{tmp_path}'")):
        run(str(tmp_path), False)


def test_a_backup_from_past_the_fit_is_refused_not_deleted(tmp_path):
    """A fit ending before the epoch a backup was saved in (an earlier phase
    of a batch schedule, run again after a restart) refuses it rather than
    restoring it, training nothing and deleting it."""
    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        run(backup, False, [Interrupt(13)], save_freq=3)
    saved = (backup / "state.json").read_text()
    assert json.loads(saved)["epoch"] == 2
    model, dataset, steps = model_and_data(False)
    with pytest.raises(ValueError, match=r"holds a backup saved at epoch 2 "
                       r"\(batch 2\), past the end of this fit \(epochs=2\): "
                       r"one BackupAndRestore serves one fit"):
        model.fit(dataset, epochs=2, steps_per_epoch=steps, verbose=0,
                  callbacks=[callbacks.BackupAndRestore(backup, save_freq=3)])
    assert (backup / "state.json").read_text() == saved
