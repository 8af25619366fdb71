"""Training-state checkpoints for resuming after a failure.

A checkpoint holds everything a resumed run needs to continue exactly where
the saved one was: model weights (with BatchNorm statistics), optimizer state
(step count, momentum slots, loss scale) and the random-number states of
layers such as Dropout. The step count is the data position: the input
pipelines are deterministic given their seed, so a resumed run skips that
many batches.

Only the chief writes, and atomically: into a fresh directory that is renamed
into place, then `state.json` (naming it) is replaced, so a crash at any
moment leaves the previous checkpoint complete and named.

State that differs between workers (PowerSGD's error feedback: the
strategy's `worker_state`) cannot be in the chief's checkpoint: each worker
writes its own, atomically, under `worker-state/step-N/worker-R-of-W/`
(`save_worker_state`), before the chief names step N in `state.json`, and
`restore` reads it back on each worker.
"""

import glob
import itertools
import json
import os
import re
import shutil
import uuid

from absl import logging
import tensorflow as tf

from tfscale._private import accessors
from tfscale._private import keras_hooks
from tfscale._private import tf_collectives

STATE_FILE = "state.json"
WORKER_STATE_DIR = "worker-state"
_KEEP = 2  # checkpoints kept: the newest one and the one before it
# Seconds a worker waits at the barrier after writing its own state.
_BARRIER_SECONDS = 3600
_worker_state_saves = itertools.count()  # every worker saves in the same order


def _trackable_state(model):
    return tf.train.Checkpoint(
        model=model, optimizer=model.optimizer,
        seed_states=accessors.seed_generator_states(model),
    )


def state(directory):
    """What `save` recorded with the newest checkpoint (its `step`, its
    `checkpoint` directory and the `extra` entries), or `None`."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def latest(directory):
    """(step, checkpoint prefix) of the newest checkpoint, or (0, None)."""
    saved = state(directory)
    if saved is None:
        return 0, None
    return saved["step"], os.path.join(directory, saved["checkpoint"], "ckpt")


def restore(model, directory):
    """Restores the newest checkpoint in `directory` into a compiled `model`.

    Call it inside the strategy scope that built the model.

    Returns:
        The step it was saved at (0 when there is none, nothing restored).
    """
    step, prefix = latest(directory)
    if prefix is None:
        return 0
    # Optimizer slots are created lazily; they must exist to be restored.
    model.optimizer.build(model.trainable_variables)
    _trackable_state(model).read(prefix).assert_existing_objects_matched()
    _restore_worker_state(model, directory, step)
    return step


def _worker_state(model):
    """The strategy's `worker_state(model)` (`tfscale.Strategy`), or `None`."""
    get = getattr(model.distribute_strategy, "worker_state", None)
    return None if get is None else get(model)


def _worker_state_path(directory, step, rank, num_workers):
    return os.path.join(directory, WORKER_STATE_DIR, f"step-{step:09d}",
                        f"worker-{rank}-of-{num_workers}")


def save_worker_state(model, directory, step):
    """Writes this worker's own state (see the module) for `step`; EVERY worker
    calls it at the same point, before the chief's `save`.

    Each worker writes atomically (a fresh directory renamed into place), then
    all wait for each other, so that `state.json` never names a step whose
    worker state is incomplete. Nothing happens without such state.
    """
    state = _worker_state(model)
    if state is None:
        return
    strategy = model.distribute_strategy
    path = _worker_state_path(directory, step, strategy.worker_index,
                              strategy.num_workers)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_directory(tf.train.Checkpoint(state=state), path)
    # This worker's files of older steps (the chief keeps _KEEP checkpoints).
    root = os.path.join(directory, WORKER_STATE_DIR)
    steps = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    for old in steps[:-_KEEP]:
        shutil.rmtree(os.path.join(root, old, os.path.basename(path)),
                      ignore_errors=True)
        try:
            os.rmdir(os.path.join(root, old))  # the last worker out removes it
        except OSError:
            pass
    timeout = getattr(getattr(strategy, "communication", None), "timeout_seconds", None)
    tf_collectives.wait_for_all_workers(
        f"tfscale worker state {next(_worker_state_saves)}: step {step}",
        timeout or _BARRIER_SECONDS)


def _restore_worker_state(model, directory, step):
    state = _worker_state(model)
    if state is None:
        return
    strategy = model.distribute_strategy
    num_workers = strategy.num_workers
    path = _worker_state_path(directory, step, strategy.worker_index, num_workers)
    if os.path.isdir(path):
        tf.train.Checkpoint(state=state).read(
            os.path.join(path, "ckpt")).assert_existing_objects_matched()
        return
    step_dir = os.path.dirname(path)
    saved = sorted(os.listdir(step_dir)) if os.path.isdir(step_dir) else []
    counts = {int(m.group(1)) for m in map(re.compile(r"worker-\d+-of-(\d+)$").match, saved)
              if m}
    if not counts:
        logging.warning(
            "The checkpoint of step %d in %s holds no PowerSGD state (it was "
            "written without compression='powersgd'): PowerSGD starts with zero "
            "error feedback and a fresh Q.", step, directory)
        return
    saved_workers = max(counts)
    if saved_workers == num_workers:
        raise FileNotFoundError(
            f"The checkpoint of step {step} in {directory} lacks this worker's "
            f"PowerSGD state ({path}): it was deleted after the checkpoint was "
            "written. Restore an older checkpoint, or start without it.")
    # Q is the same on every worker: take worker 0's; error feedback belongs
    # to one worker each and cannot be split among another number of them.
    reader = tf.train.Checkpoint(state=_QOnly(state.q))
    reader.read(os.path.join(_worker_state_path(directory, step, 0, saved_workers),
                             "ckpt")).expect_partial().assert_existing_objects_matched()
    logging.warning(
        "The checkpoint of step %d in %s holds PowerSGD error feedback of %d "
        "workers; this run has %d. Each worker's error feedback belongs to its "
        "own gradients and cannot be split among another number of workers: it "
        "starts from zero (the compression errors of the last step are dropped), "
        "Q is restored.", step, directory, saved_workers, num_workers)


class _QOnly(tf.Module):
    """Reads only the Q of a saved `powersgd.State` (same checkpoint keys)."""

    def __init__(self, q):
        super().__init__()
        self.q = q


def _write_directory(trackable, final):
    """Writes the `tf.train.Checkpoint` `trackable` as `final/ckpt`,
    atomically: into a fresh directory beside `final`, renamed into place."""
    partial = os.path.join(os.path.dirname(final), f".partial-{uuid.uuid4().hex[:8]}")
    try:
        trackable.write(os.path.join(partial, "ckpt"))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def restore_model(model, prefix):
    """Restores only `model`'s variables (weights and BatchNorm statistics)
    from the checkpoint at `prefix` (as `latest` names it).

    For evaluation and inference: the optimizer state and random-number
    states the checkpoint also holds are left unread, so `model` needs no
    optimizer, or may have another one.

    Raises:
        tf.errors.NotFoundError: no checkpoint at `prefix` (pruned after a
            newer one was written, see `save`).
    """
    tf.train.Checkpoint(model=model).read(prefix).expect_partial(
    ).assert_existing_objects_matched()


def save(model, directory, step, extra=None):
    """Writes a checkpoint of `model` at `step` (chief only), atomically.

    `extra` (a JSON-serializable dict) is recorded with it; `state` reads it.
    """
    os.makedirs(directory, exist_ok=True)
    # A writer killed mid-save (SIGKILL skips `finally`) leaves its partial
    # directory; only the chief saves here, one save at a time.
    for stale in glob.glob(os.path.join(directory, ".partial-*")):
        shutil.rmtree(stale, ignore_errors=True)
    name = f"step-{step:09d}"
    _write_directory(_trackable_state(model), os.path.join(directory, name))
    state_path = os.path.join(directory, STATE_FILE)
    with open(state_path + ".tmp", "w") as f:
        json.dump({**(extra or {}), "step": step, "checkpoint": name}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(state_path + ".tmp", state_path)
    saved = sorted(d for d in os.listdir(directory) if d.startswith("step-"))
    for old in saved[:-_KEEP]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def step(model):
    """Steps the model has trained: batches its optimizer has taken (with
    gradient accumulation each micro-batch counts, not only the updates)."""
    return keras_hooks.batches_taken(model.optimizer)
