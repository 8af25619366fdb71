"""Distributed datasets that a CPU worker reads with a plain iterator
(private TensorFlow APIs; see `tfscale._private`).

MultiWorkerMirroredStrategy hands each worker's batches to its devices
through a `MultiDeviceIterator` (tensorflow/python/distribute/input_lib.py,
`_should_use_multi_device_iterator`), which prefetches them onto each
device. A tfscale worker has one replica; on a CPU worker its device is the
host the dataset runs on, so there is nothing to fetch, yet every iterator
made (each epoch of `fit`, each `evaluate` and `predict`) traces the
MultiDeviceIterator's own functions again (`python -m
tfscale.launch.studies.input_iterator_cost` times both). TensorFlow already
reads a dataset with a plain iterator on the host for
`InputOptions(experimental_replication_mode=PER_REPLICA,
experimental_fetch_to_device=False)`, which MWMS's public methods refuse;
these functions build that dataset as MWMS builds its own, with those
options. tests/test_host_input.py checks that `tfscale.Strategy` reads so,
and gives the same batches.
"""

import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.distribute import input_util

# What TensorFlow reads with `iter(dataset)` on the worker's host
# (`_SingleWorkerOwnedDatasetIterator._make_iterator`).
ON_HOST = tf.distribute.InputOptions(
    experimental_fetch_to_device=False,
    experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)


def distribute_dataset(strategy, dataset):
    """`strategy.experimental_distribute_dataset(dataset)`, read on the host
    (MWMS's `_experimental_distribute_dataset` with `ON_HOST`)."""
    extended = strategy.extended
    return input_util.get_distributed_dataset(
        dataset, extended._input_workers_with_options(ON_HOST), strategy,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
        input_context=extended._make_input_context(), options=ON_HOST)


def distribute_datasets_from_function(strategy, dataset_fn):
    """`strategy.distribute_datasets_from_function(dataset_fn)`, read on the
    host (MWMS's `_distribute_datasets_from_function` with `ON_HOST`)."""
    extended = strategy.extended
    return input_util.get_distributed_datasets_from_function(
        dataset_fn=dataset_fn,
        input_workers=extended._input_workers_with_options(ON_HOST),
        input_contexts=[extended._make_input_context()], strategy=strategy,
        options=ON_HOST)


def reads_on_host(distributed_iterator):
    """Whether each worker's part of `distributed_iterator` (from `iter` of a
    distributed dataset) is a plain iterator, not a MultiDeviceIterator."""
    return not any(isinstance(worker._iterator, _MULTI_DEVICE_ITERATORS)
                   for worker in distributed_iterator._iterators)


_MULTI_DEVICE_ITERATORS = (multi_device_iterator_ops.OwnedMultiDeviceIterator,
                           multi_device_iterator_ops.MultiDeviceIterator)
