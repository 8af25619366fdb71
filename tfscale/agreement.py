"""Agreement at start: every worker must train with the same settings.

Workers launched with different flags (a stale config on one machine, a
typo in one pod) would otherwise train silently wrong or hang in mismatched
collectives. Each worker gathers every worker's settings and, on any
difference, all of them stop with the same message.
"""

import json

import numpy as np
import tensorflow as tf


class WorkersDisagreeError(ValueError):
    """Workers were started with different settings."""


def gather(strategy, array):
    """Stacks this worker's NumPy `array` with every other worker's.

    Every worker must call it at the same point, outside `tf.function`, with an
    array of the same shape and dtype. Returns the stacked array, by worker index.

    Under a `tfscale.Strategy` this is one eager all-gather on its
    `collective_group`, watched by its collective timeout. TensorFlow's
    `strategy.gather` traces a `tf.function` anew at every call (its
    `_batch_all_gather`): 0.1 CPU-seconds a gather against 0.005 on 2 CPU
    workers, paid at every `fit` and every epoch (`tfscale.uneven_data`, the
    straggler report, preemption).
    """
    array = np.asarray(array)
    if array.dtype not in _GATHERED:
        raise ValueError(
            "tfscale.agreement.gather gathers arrays of "
            f"{', '.join(d.name for d in _GATHERED)}; cast it to one of them. "
            f"Received: array.dtype={array.dtype.name}")
    group = getattr(strategy, "collective_group", None)
    if strategy.num_replicas_in_sync == 1:
        return array[None]
    if group is None:  # another strategy
        values = strategy.experimental_distribute_values_from_function(
            lambda _: tf.constant(array[None]))
        return strategy.gather(values, axis=0).numpy()
    # The group's members come in TensorFlow's device order, which need not
    # be the workers' (`CollectiveGroup.all_gather`): each row carries its
    # worker's index first.
    row = np.concatenate([np.array([strategy.worker_index], array.dtype), array.ravel()])
    rows = group.all_gather(tf.constant(row)).numpy().reshape(
        strategy.num_replicas_in_sync, row.size)
    return rows[np.argsort(rows[:, 0]), 1:].reshape((-1,) + array.shape)


# What TensorFlow's all-gather takes, less float16: each holds any worker's
# index exactly, as `gather` tags the rows.
_GATHERED = tuple(np.dtype(d) for d in (np.int32, np.int64, np.float32, np.float64))


def gather_settings(strategy, settings):
    """Every worker's `settings` (a JSON-serializable dict), by worker index."""
    payload = np.frombuffer(json.dumps(settings, sort_keys=True).encode(), np.uint8)
    lengths = gather(strategy, np.array([payload.size], np.int32))[:, 0]
    padded = np.zeros(lengths.max(), np.int32)
    padded[: payload.size] = payload
    rows = gather(strategy, padded)
    return [json.loads(bytes(row[:n].astype(np.uint8)).decode())
            for row, n in zip(rows, lengths)]


def differences(all_settings):
    """Lines `name: value on worker 0, other on worker 1` per differing setting."""
    lines = []
    names = sorted(set().union(*all_settings))
    for name in names:
        values = [s.get(name, "<unset>") for s in all_settings]
        if any(v != values[0] for v in values):
            groups = {}
            for index, value in enumerate(values):
                groups.setdefault(json.dumps(value), []).append(index)
            lines.append(f"{name}: " + ", ".join(
                f"{json.loads(value)} on worker{'s' if len(idx) > 1 else ''} "
                f"{', '.join(map(str, idx))}" for value, idx in groups.items()))
    return lines


def barrier(strategy):
    """Returns a function that blocks until every worker has called it.

    One all-reduce of a scalar, traced once: build the barrier once and call
    it as often as needed, on every worker, at the same points.
    """
    one = tf.constant([1.0])

    @tf.function
    def wait_for_all():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.identity(one)))

    return wait_for_all


def check_settings_agree(strategy, settings):
    """Raises `WorkersDisagreeError` on every worker if any settings differ."""
    if strategy.num_replicas_in_sync == 1:
        return
    lines = differences(gather_settings(strategy, settings))
    if lines:
        raise WorkersDisagreeError(
            "Workers were started with different settings; start every worker "
            "with the same flags and versions:\n  " + "\n  ".join(lines)
        )
