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

Storage fails in two ways a resume must survive. Bit rot on a shared volume:
before resuming, `recover` reads the whole newest checkpoint (TensorBundle
checks every tensor's CRC32C); a corrupt one is moved aside, never deleted,
and training resumes from the newest intact one, each checkpoint carrying its
own record for that. A full disk: `save` raises `CheckpointWriteError` naming
the path and the bytes it needed, and the last good checkpoint stays named.
"""

import errno
import glob
import itertools
import json
import os
import re
import shutil
import time
import uuid

from absl import logging
import numpy as np
import tensorflow as tf

from tfscale import _atomic
from tfscale._private import accessors
from tfscale._private import keras_hooks
from tfscale._private import tf_collectives

STATE_FILE = "state.json"
# Where `recover` moves a corrupt checkpoint: beside the others, never read.
CORRUPT_PREFIX = "corrupt-"
WORKER_STATE_DIR = "worker-state"
_KEEP = 2  # checkpoints kept: the newest one and the one before it
# Seconds a worker waits at the barrier after writing its own state.
_BARRIER_SECONDS = 3600
_worker_state_saves = itertools.count()  # every worker saves in the same order
_recoveries = itertools.count()  # every worker recovers in the same order


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
    if saved is None or saved["checkpoint"] is None:  # None: see `recover`
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


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only volume);
    the previous one stays complete and named."""


class NoIntactCheckpointError(RuntimeError):
    """`state.json` names checkpoints, and none of them can be read."""


def _write_directory(trackable, final, record=None):
    """Writes the `tf.train.Checkpoint` `trackable` as `final/ckpt` (and
    `record` as `final/state.json`), atomically: into a fresh directory
    beside `final`, renamed into place."""
    partial = os.path.join(os.path.dirname(final), f".partial-{uuid.uuid4().hex[:8]}")
    try:
        trackable.write(os.path.join(partial, "ckpt"))
        if record is not None:
            _write_json(os.path.join(partial, STATE_FILE), record)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _write_json(path, record):
    """Writes `record` to `path` atomically (a temporary file, fsync, rename)."""
    _atomic.write_json(path, record)


def _no_space(error):
    return (isinstance(error, tf.errors.ResourceExhaustedError)
            or getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            or "No space left on device" in str(error))


def bytes_needed(model):
    """Bytes of the variables a checkpoint of `model` holds (its size, about)."""
    variables = {id(v): v for v in [*model.variables, *model.optimizer.variables]}
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
               for v in variables.values())


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
    record = {**(extra or {}), "step": step, "checkpoint": name}
    try:
        # The record in the checkpoint too: `recover` may resume from it
        # when a newer one turns out corrupt.
        _write_directory(_trackable_state(model), os.path.join(directory, name),
                         record)
        _write_json(os.path.join(directory, STATE_FILE), record)
    except (OSError, tf.errors.OpError) as error:
        if not _no_space(error):
            raise
        free = shutil.disk_usage(directory).free
        kept = state(directory)
        kept = (f"the checkpoint of step {kept['step']} stays the one a relaunch "
                "resumes from" if kept else "there is no earlier checkpoint")
        failure = CheckpointWriteError(
            f"No space left on device for the checkpoint of step {step} in "
            f"{directory}: it needs about {bytes_needed(model):,} bytes and "
            f"{free:,} are free there ({type(error).__name__}); {kept}. "
            "Free space or point --model_dir elsewhere, then relaunch.")
        failure.errno = errno.ENOSPC
        raise failure from None
    saved = sorted(d for d in os.listdir(directory) if d.startswith("step-"))
    for old in saved[:-_KEEP]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def _read_every_tensor(prefix):
    """Reads the whole checkpoint at `prefix`: TensorBundle checks each
    tensor's CRC32C as it reads, so bit rot raises `DataLossError` here."""
    reader = tf.train.load_checkpoint(prefix)
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name)


def _older_records(directory, newest):
    """The records of the checkpoints older than `newest` that carry one,
    newest first (checkpoints from before records were kept carry none)."""
    records = []
    for name in sorted(os.listdir(directory), reverse=True):
        path = os.path.join(directory, name, STATE_FILE)
        if name.startswith("step-") and name != newest["checkpoint"] and (
                os.path.exists(path)):
            with open(path) as f:
                record = json.load(f)
            if record["step"] < newest["step"]:
                records.append(record)
    return records


def _find_intact(directory):
    """(the newest intact record or None, [(record, error) of corrupt ones])."""
    newest = state(directory)
    corrupt = []
    for record in [newest, *_older_records(directory, newest)]:
        try:
            _read_every_tensor(os.path.join(directory, record["checkpoint"], "ckpt"))
        except tf.errors.OpError as error:  # checksum, truncation, a missing file
            corrupt.append((record, error))
            continue
        return record, corrupt
    return None, corrupt


def first_line(error):
    """The first non-empty line of `error`'s message, spaces collapsed (its
    type's name when it has none): TensorFlow's errors carry a stack after."""
    message = getattr(error, "message", None) or str(error)
    lines = [line for line in message.splitlines() if line.strip()]
    return " ".join(lines[0].split()) if lines else type(error).__name__


def recover(directory, is_chief, timeout_seconds=_BARRIER_SECONDS):
    """Before resuming from `directory`: makes `state.json` name the newest
    checkpoint that reads back whole. EVERY worker calls it, at the same
    point, before `state`, `latest` or `restore`.

    The chief reads the checkpoint `state.json` names, every tensor of it
    (TensorBundle's checksums); if that fails (bit rot, a truncated file, a
    missing one), it moves the checkpoint aside to `corrupt-step-N-<time>`
    (never deleting it), tries the next older one that carries its record,
    and names the first intact one in `state.json`, with what it found. The
    other workers wait for it, then every worker logs what happened.

    Returns:
        The step resumed from (0: nothing to resume).

    Raises:
        NoIntactCheckpointError: no checkpoint in `directory` reads back.
    """
    saved = state(directory)
    if is_chief and saved is not None and "unreadable" not in saved:
        _recover_as_chief(directory)
    # Not named by `directory`: each worker may mount the storage elsewhere.
    tf_collectives.wait_for_all_workers(
        f"tfscale checkpoint recovery {next(_recoveries)}", timeout_seconds)
    saved = state(directory)
    if saved is None:
        return 0
    if "unreadable" in saved:
        raise NoIntactCheckpointError(saved["unreadable"])
    for moved in saved.get("moved_aside", []):
        logging.warning(
            "The checkpoint of step %d in %s is corrupt (%s): moved aside to %s "
            "(kept, not deleted); resuming from the checkpoint of step %d, the "
            "newest that reads back whole.", moved["step"], directory,
            moved["error"], moved["to"], saved["step"])
    return saved["step"]


def _recover_as_chief(directory):
    intact, corrupt = _find_intact(directory)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = []
    for record, error in corrupt:
        source = os.path.join(directory, record["checkpoint"])
        target = f"{CORRUPT_PREFIX}{record['checkpoint']}-{stamp}"
        if os.path.isdir(source):
            os.rename(source, os.path.join(directory, target))
        else:  # nothing to move: its directory is gone
            target = f"nowhere ({record['checkpoint']} is missing)"
        moved.append({"step": record["step"], "to": target,
                      "error": first_line(error)})
    if not corrupt:
        return
    if intact is None:
        unreadable = (
            f"No checkpoint in {directory} reads back whole: "
            + "; ".join(f"step {m['step']} ({m['error']}), moved to {m['to']}"
                        for m in moved)
            + ". Start afresh with another --model_dir, or restore a copy.")
        _write_json(os.path.join(directory, STATE_FILE),
                    {"step": 0, "checkpoint": None, "unreadable": unreadable})
        return
    _write_json(os.path.join(directory, STATE_FILE), {**intact, "moved_aside": moved})


def step(model):
    """Steps the model has trained: batches its optimizer has taken (with
    gradient accumulation each micro-batch counts, not only the updates)."""
    return keras_hooks.batches_taken(model.optimizer)
