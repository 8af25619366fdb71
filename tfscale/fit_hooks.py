"""What tfscale checks and changes at the start of each `fit`, `evaluate` or
`predict` under a multi-worker strategy (before the callbacks see the model).

Every worker runs the same script, so every worker's `fit` holds the same
callbacks writing to the same paths:

- `keras.callbacks.BackupAndRestore` is refused on every worker, naming
  `tfscale.callbacks.BackupAndRestore`: its workers would all write the same
  `latest.weights.h5` (h5py refuses the lock and the fit dies), and its
  resume restarts the saved epoch from its first batch.
- `ModelCheckpoint`, `TensorBoard` and `CSVLogger` write as usual on the
  chief; on the other workers they write into a temporary directory, deleted
  when `fit` ends, as TensorFlow's Keras 2 multi-worker code did. They need
  nothing from the other workers: the logs they see are averaged over all
  workers already.

And `jit_compile=True` (XLA) on two or more CPU workers is refused in one
line: XLA compiles collectives on GPUs, but not on CPUs, where the step would
fail deep in graph execution ("Collectives are not yet implemented for CPU
devices when compiling with XLA"). Keras's default, `jit_compile="auto"`, is
`False` under a distribution strategy. Steps compiled by XLA are not timed
(see `CommunicationOptions.time_all_reduces`).

Under `algorithm="auto"`, once the tuned all-reduces still running have
made their choice (`AutoTuner.retrace_due`), Keras builds the train and
test functions anew after the batch, on every worker or on none (where a
worker's are wrapped by code tfscale does not know): traced again, each
all-reduce runs its choice as a fixed plan (tfscale/collectives/autotune.py
says why).

`tfscale.strategy` installs these with a predicate that tells its
strategies (`install`); this module imports no strategy.
"""

import atexit
import os
import shutil
import tempfile

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfscale import agreement
from tfscale._private import accessors
from tfscale._private import keras_hooks

# callback class -> the attribute holding the path it writes to
_REDIRECTED = {
    keras.callbacks.ModelCheckpoint: "filepath",
    keras.callbacks.TensorBoard: "log_dir",
    keras.callbacks.CSVLogger: "filename",
}
# id(callback) -> (callback, attribute, user's path) of each redirected one
_redirected = {}
_temporary_dirs = []
# `applies(strategy)`: whether the rules apply to a model under `strategy`
# (given to `install`).
_applies = [lambda strategy: False]


def install(applies):
    """Applies this module's rules to every later `fit` of a model whose
    strategy `applies(strategy)` accepts and has two or more workers (once
    per process; a second call replaces `applies`)."""
    _applies[0] = applies
    keras_hooks.add_fit_hooks(_on_set_model, _on_train_end)
    keras_hooks.add_train_batch_end_hook(_after_train_batch)


def _multi_worker_strategy(model):
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is not None and _applies[0](strategy) and strategy.num_workers > 1:
        return strategy
    return None


def check_jit_compile(model, strategy):
    """Raises ValueError if `model` compiles with XLA on 2+ CPU workers."""
    if not model.jit_compile or strategy.num_workers < 2:
        return
    devices = accessors.local_devices(strategy)
    if any(tf.DeviceSpec.from_string(d).device_type != "CPU" for d in devices):
        return
    raise ValueError(
        f"jit_compile=True cannot run on {strategy.num_workers} workers on CPU: "
        "XLA does not compile collectives for CPU devices (TensorFlow: "
        "'Collectives are not yet implemented for CPU devices when compiling "
        "with XLA'). Compile with jit_compile=False, or keep Keras's default "
        "'auto' (False under a distribution strategy); on GPUs XLA compiles "
        f"them. Received: jit_compile=True, devices={devices}"
    )


def _on_set_model(callback_list, model):
    strategy = _multi_worker_strategy(model)
    if strategy is None:
        return
    check_jit_compile(model, strategy)
    for callback in callback_list.callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise ValueError(
                "keras.callbacks.BackupAndRestore cannot back up a fit with "
                f"{strategy.num_workers} workers: every worker writes the same "
                "file. Use tfscale.callbacks.BackupAndRestore(backup_dir, "
                "save_freq=..., delete_checkpoint=...) instead (the same "
                "arguments; only the chief writes, and a resume continues at the "
                "saved step). Received: callbacks=[..., "
                f"keras.callbacks.BackupAndRestore(backup_dir={callback.backup_dir!r}), ...]"
            )
    if strategy.is_chief:
        return
    for callback in callback_list.callbacks:
        for cls, attribute in _REDIRECTED.items():
            if isinstance(callback, cls) and id(callback) not in _redirected:
                _redirect(callback, attribute)


def _after_train_batch(model):
    strategy = _multi_worker_strategy(model)
    tuner = getattr(strategy, "autotune", None)
    if tuner is None or not tuner.retrace_due():
        return
    # Every worker traces again or none does: their collectives must match.
    # retrace_due is True at the same batch everywhere; what wraps the
    # functions may not be the same everywhere (a callback on the chief only).
    able = agreement.gather(
        strategy, np.array([keras_hooks.can_retrace_train_function(model)], np.int32))
    if able.all():
        keras_hooks.retrace_train_function(model)
        return
    logging.warning(
        "tfscale autotune: model.train_function or test_function is wrapped by "
        "code tfscale does not know on worker(s) %s, so no worker traces it again: "
        "the chosen all-reduce keeps running through the trials' switches "
        "(correct, slower). To run it as fast as a fixed plan, name the chosen "
        "algorithm and fusion threshold (the chief logged them) instead of "
        "algorithm='auto'.", ", ".join(str(i) for i in np.flatnonzero(able == 0)))


def _redirect(callback, attribute):
    directory = tempfile.mkdtemp(prefix="tfscale-worker-")
    _temporary_dirs.append(directory)
    path = getattr(callback, attribute)
    # The whole path below the temporary directory: formats such as
    # "{epoch}" in any part of it keep working.
    redirected = os.path.join(directory, path.lstrip(os.sep))
    # Its parent exists, as the user's does where the chief writes
    # (CSVLogger does not create it).
    os.makedirs(os.path.dirname(redirected), exist_ok=True)
    setattr(callback, attribute, redirected)
    _redirected[id(callback)] = (callback, attribute, path)


def _on_train_end(callback_list):
    del callback_list
    for callback, attribute, path in _redirected.values():
        setattr(callback, attribute, path)
    _redirected.clear()
    _remove_temporary_dirs()


@atexit.register
def _remove_temporary_dirs():
    """Removes the non-chief workers' files (also after a failed fit)."""
    while _temporary_dirs:
        shutil.rmtree(_temporary_dirs.pop(), ignore_errors=True)
