"""Accessors of TensorFlow and Keras state that has no public one (private
APIs; see `tfscale._private`)."""

import tensorflow as tf
from tensorflow.python.framework import config as tf_config
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

def in_xla_context():
    """Whether the graph being built is compiled by XLA (a `tf.function`
    with `jit_compile=True`, or one it calls)."""
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def op_determinism_enabled():
    """Whether `tf.config.experimental.enable_op_determinism()` is on
    (TensorFlow exports no getter)."""
    return tf_config.is_op_determinism_enabled()


def cluster_spec_dict(strategy):
    """The cluster spec MWMS resolved, as {job: [address, ...]}; {} alone."""
    return strategy.extended._cluster_resolver.cluster_spec().as_dict()


def local_devices(strategy):
    """The devices this worker's replicas run on."""
    return list(strategy.extended.worker_devices)


def flatten_layers(model):
    """Every layer nested in `model` (not `model` itself), depth first.

    Keras 3 has no public recursive walk: `model.layers` stops at the first
    level, and a BatchNormalization inside a nested block would be missed.
    """
    return list(model._flatten_layers(include_self=False))


def seed_generator_states(model):
    """The state variables of the `SeedGenerator`s (Dropout's...) in `model`.

    `tf.train.Checkpoint` does not reach them through the model; without them
    a resumed Dropout draws other masks. Keras names them by this path.
    """
    return [v.value for v in model.variables if "seed_generator_state" in v.path]


def cardinality(distributed_dataset):
    """The number of batches TensorFlow gives a distributed dataset (a
    tf.data cardinality: >= 0, or `INFINITE`, `UNKNOWN`)."""
    return int(distributed_dataset.cardinality)


def set_cardinality(distributed_dataset, value):
    """Makes every iterator of `distributed_dataset` (from
    `distribute_datasets_from_function`, not yet iterated) count `value`
    batches, with partial-batch handling unless `value` is `INFINITE` (the
    workers without data then get empty batches), as TensorFlow sets both
    from the first pipeline's cardinality when it builds the dataset."""
    distributed_dataset._cardinality = value
    distributed_dataset._enable_get_next_as_optional = (
        value != tf.data.INFINITE_CARDINALITY)
