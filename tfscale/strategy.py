"""`tfscale.Strategy`: MultiWorkerMirroredStrategy with a working Keras 3 fit.

Two things separate it from stock MWMS:
- `reduce` accepts what Keras 3 hands it (nests; rank-0 values with `axis=0`),
  which makes `model.fit`, `evaluate` and `predict` work with 2+ workers
  (keras-team/keras#20585, tensorflow/tensorflow#72388).
- Dense all-reduces (gradients, metrics, losses) go through tfscale's fused
  collectives, configured by `CommunicationOptions`.
"""

import functools

import tensorflow as tf

from tfscale import _tf_private
from tfscale import collectives

_MiB = 1024 * 1024


class CommunicationOptions:
    """How `tfscale.Strategy` all-reduces.

    Args:
        algorithm: all-reduce algorithm for each fused buffer. `"ring"`: one
            flat ring over all workers.
        fusion_threshold_bytes: gradients are packed, last layer first, into
            buffers that are sent once they reach this size; 0 sends each
            tensor on its own.
        timeout_seconds: a collective that has not completed after this many
            seconds fails, so a lost worker stops its peers instead of leaving
            them waiting forever. It must exceed the longest time one worker
            can legitimately run ahead of the others (the chief writing a
            checkpoint or an export, a slow first step while graphs are
            built); `None` waits forever, as stock MWMS does.
    """

    ALGORITHMS = tuple(collectives.ALGORITHMS)

    def __init__(
        self,
        algorithm="ring",
        fusion_threshold_bytes=32 * _MiB,
        timeout_seconds=300,
    ):
        if algorithm not in self.ALGORITHMS:
            raise ValueError(
                f"Argument `algorithm` must be one of {list(self.ALGORITHMS)}. "
                f"Received: algorithm={algorithm!r}"
            )
        if (
            not isinstance(fusion_threshold_bytes, int)
            or isinstance(fusion_threshold_bytes, bool)
            or fusion_threshold_bytes < 0
        ):
            raise ValueError(
                "Argument `fusion_threshold_bytes` must be an integer >= 0. "
                f"Received: fusion_threshold_bytes={fusion_threshold_bytes!r}"
            )
        if timeout_seconds is not None and (
            not isinstance(timeout_seconds, (int, float))
            or isinstance(timeout_seconds, bool)
            or timeout_seconds <= 0
        ):
            raise ValueError(
                "Argument `timeout_seconds` must be a number > 0, or None to "
                f"wait forever. Received: timeout_seconds={timeout_seconds!r}"
            )
        self.algorithm = algorithm
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.timeout_seconds = timeout_seconds

    def get_config(self):
        return {
            "algorithm": self.algorithm,
            "fusion_threshold_bytes": self.fusion_threshold_bytes,
            "timeout_seconds": self.timeout_seconds,
        }

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"CommunicationOptions({args})"

    def __eq__(self, other):
        return (
            isinstance(other, CommunicationOptions)
            and self.get_config() == other.get_config()
        )


class Strategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data-parallel training over the workers in TF_CONFIG.

    Without TF_CONFIG this is one worker. With it, each worker process runs
    one replica (one device per process, as with Horovod) and the global batch
    is split evenly across them. Use it as any `tf.distribute.Strategy`:

    ```python
    strategy = tfscale.Strategy()
    with strategy.scope():
        model = models.resnet50(num_classes=1000)
        model.compile(optimizer=..., loss=...)
    model.fit(dataset, epochs=...)
    ```

    Args:
        communication: a `tfscale.CommunicationOptions`; defaults to its
            defaults.
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            (for example `SlurmClusterResolver`); defaults to TF_CONFIG.
    """

    def __init__(self, communication=None, cluster_resolver=None):
        if communication is None:
            communication = CommunicationOptions()
        if not isinstance(communication, CommunicationOptions):
            raise TypeError(
                "Argument `communication` must be a "
                "`tfscale.CommunicationOptions`. "
                f"Received: communication={communication!r}"
            )
        _tf_private.check_versions()
        super().__init__(
            cluster_resolver=cluster_resolver,
            communication_options=tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=communication.timeout_seconds
            ),
        )
        devices = _tf_private.local_devices(self)
        if len(devices) > 1:
            raise ValueError(
                "tfscale runs one replica per worker process, as Horovod runs "
                f"one process per GPU; this worker sees devices {devices}. "
                "Start one worker per device and limit each to its own, e.g. "
                "with CUDA_VISIBLE_DEVICES."
            )
        self.communication = communication
        self._tfscale_cross_device_ops = _tf_private.install_cross_device_ops(
            self,
            functools.partial(
                collectives.fused_all_reduce,
                algorithm=communication.algorithm,
                fusion_threshold_bytes=communication.fusion_threshold_bytes,
            ),
            timeout_seconds=communication.timeout_seconds,
        )

    @property
    def num_workers(self):
        """Number of worker processes training together."""
        return self.num_replicas_in_sync

    @property
    def worker_index(self):
        """This worker's index in TF_CONFIG's worker list (0 alone)."""
        return self.cluster_resolver.task_id or 0

    @property
    def is_chief(self):
        """Whether this worker logs, checkpoints and exports (worker 0)."""
        return self.worker_index == 0

    def reduce(self, reduce_op, value, axis=None):
        """`tf.distribute.Strategy.reduce`, mapped over nests.

        Keras 3 reduces a whole data batch (a nest) to build the model and
        reduces scalar metrics with `axis=0`; multi-worker MWMS rejects both.
        Rank-0 values are reduced across replicas only.
        """
        parent_reduce = super().reduce

        def reduce_one(v):
            rank = _rank(v)
            return parent_reduce(
                reduce_op, v, axis=None if rank == 0 else axis
            )

        return tf.nest.map_structure(reduce_one, value)


def _rank(value):
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    return tf.convert_to_tensor(value).shape.rank
