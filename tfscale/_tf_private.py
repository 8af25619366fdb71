"""Every private TensorFlow/Keras API that tfscale uses, and nothing else.

TensorFlow exports no hook for replacing how MultiWorkerMirroredStrategy
all-reduces, nor the raw collective ops over sub-groups of its cluster; tfscale
needs both. Those uses are confined to this module so that a TensorFlow or
Keras upgrade has one place to check. They are tested against the versions
pinned in setup.py; tests/test_tf_private.py fails loudly if a hook stops
being called.
"""

import keras
import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import cross_device_ops as tf_cross_device_ops
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.ops import collective_ops
from tensorflow.python.util import nest

# Versions whose private APIs this module was written and tested against.
TESTED_VERSIONS = {"tensorflow": "2.21.", "keras": "3.15."}

# MWMS takes group keys 1, 2, ... for itself (one per device set it reduces
# over); tfscale's own sub-groups start well above them.
_SUBGROUP_KEY_BASE = 1000


def check_versions():
    """Warns when TensorFlow or Keras differ from the tested versions."""
    found = {"tensorflow": tf.__version__, "keras": keras.__version__}
    for package, prefix in TESTED_VERSIONS.items():
        if not found[package].startswith(prefix):
            logging.warning(
                "tfscale was tested with %s %sx and uses its private APIs; "
                "found %s. Install the pinned versions (pip install tfscale "
                "resolves them) if multi-worker training misbehaves.",
                package,
                prefix,
                found[package],
            )


class CollectiveGroup:
    """This worker's handle on one group of workers that run collectives.

    Every member must create the same groups in the same order and issue the
    same collectives in the same order: instance keys are counted locally and
    have to agree across workers.

    Args:
        launcher: the `CollectiveReplicaLauncher` (private) that allocates
            instance keys for the group and orders its collectives.
        timeout_seconds: a collective that has not completed by then fails
            instead of waiting forever for a lost peer; `None` waits forever.
    """

    def __init__(self, launcher, timeout_seconds):
        self._launcher = launcher
        self._timeout = timeout_seconds or 0

    @property
    def size(self):
        return self._launcher._group_size

    @property
    def key(self):
        return self._launcher._group_key

    @property
    def device(self):
        return self._launcher._device

    def _call_args(self):
        return dict(
            group_size=self.size,
            group_key=self.key,
            instance_key=self._launcher._next_instance_key(),
            timeout=self._timeout,
            ordering_token=self._launcher._get_ordering_token(),
        )

    def all_reduce(self, tensor):
        """Element-wise sum of `tensor` over the group (ring on CPU)."""
        with tf.device(self.device):
            return collective_ops.all_reduce_v2(
                tensor, communication_hint="ring", **self._call_args()
            )


class CrossDeviceOps(tf_cross_device_ops.CollectiveAllReduce):
    """MWMS's `CollectiveAllReduce`, with dense all-reduces routed to tfscale.

    Keras 3 reduces gradients, metrics and losses through
    `ReplicaContext.all_reduce` -> `CrossDeviceOps.batch_reduce` ->
    `CollectiveAllReduce._all_reduce`; overriding that last (private) method
    is the narrowest hook that sees all of them. Sparse values (IndexedSlices)
    keep TensorFlow's own path.

    Args:
        stock: the `CollectiveAllReduce` MWMS built; its devices, group and
            collective keys are reused so the group key stays the same.
        communication_options: the `tf.distribute.experimental.
            CommunicationOptions` MWMS was created with.
        collective_keys: MWMS's `CollectiveKeys`.
        all_reduce_fn: `fn(tensors, group) -> tensors` that sums a list of dense
            tensors over `group` (a `CollectiveGroup` of all workers).
        timeout_seconds: collective timeout for tfscale's own collectives.
    """

    def __init__(
        self, stock, communication_options, collective_keys, all_reduce_fn,
        timeout_seconds,
    ):
        super().__init__(
            devices=stock._devices,
            group_size=stock._group_size,
            options=communication_options,
            collective_keys=collective_keys,
        )
        self._all_reduce_fn = all_reduce_fn
        self._groups = [
            CollectiveGroup(launcher, timeout_seconds)
            for launcher in self._launchers
        ]
        # Sizes (number of tensors) of every dense batch routed to tfscale,
        # recorded when traced: tests use it to prove the hook is called.
        self.routed_batch_sizes = []

    def _all_reduce(self, reduce_op, value, replica_id, options):
        flat_values = nest.flatten(value)
        if any(isinstance(v, tf.IndexedSlices) for v in flat_values):
            return super()._all_reduce(reduce_op, value, replica_id, options)
        self.routed_batch_sizes.append(len(flat_values))
        group = self._groups[replica_id]
        reduced = self._all_reduce_fn(flat_values, group)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            reduced = [r / self._group_size for r in reduced]
        return nest.pack_sequence_as(value, reduced)


def install_cross_device_ops(strategy, all_reduce_fn, timeout_seconds):
    """Makes `strategy` (an MWMS) reduce through `all_reduce_fn`.

    Returns the installed `CrossDeviceOps`.
    """
    extended = strategy.extended
    ops = CrossDeviceOps(
        stock=extended._cross_device_ops,
        communication_options=extended._communication_options,
        collective_keys=extended._collective_keys,
        all_reduce_fn=all_reduce_fn,
        timeout_seconds=timeout_seconds,
    )
    extended._cross_device_ops = ops
    return ops


def cluster_spec_dict(strategy):
    """The cluster spec MWMS resolved, as {job: [address, ...]}; {} alone."""
    return strategy.extended._cluster_resolver.cluster_spec().as_dict()


def local_devices(strategy):
    """The devices this worker's replicas run on."""
    return list(strategy.extended.worker_devices)


def in_multi_worker_mode(strategy):
    return strategy.extended._in_multi_worker_mode()


