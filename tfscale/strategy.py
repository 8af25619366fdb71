"""`tfscale.Strategy`: MultiWorkerMirroredStrategy with a working Keras 3 fit.

Three things separate it from stock MWMS:
- `reduce` accepts what Keras 3 hands it (nests; rank-0 values with `axis=0`),
  which makes `model.fit`, `evaluate` and `predict` work with 2+ workers
  (keras-team/keras#20585, tensorflow/tensorflow#72388).
- All-reduces also run inside Keras's `steps_per_execution` loop
  (`loop_instance_keys`).
- Dense all-reduces (gradients, metrics, losses) go through tfscale's fused
  collectives, configured by `CommunicationOptions`.
- Under the `mixed_float16` policy, `model.compile` in its scope wraps the
  optimizer in `tfscale.optimizers.LossScaleOptimizer`, whose skip decision
  agrees across workers, instead of Keras's own (which deadlocks as soon as
  one worker overflows and another does not).
- Every Keras optimizer (LARS too) all-reduces its gradients first and then
  clips them, so `clipnorm`, `global_clipnorm` and `clipvalue` mean on N
  workers what they mean on one; `gradient_accumulation_steps=k` works and
  all-reduces once per k micro-batches.
"""

from absl import logging
import keras
import tensorflow as tf

from tfscale import _tf_private
from tfscale import collectives
from tfscale import evaluator
from tfscale import uneven_data
from tfscale import jit_compile
from tfscale import keras_callbacks
from tfscale import optimizers
from tfscale import startup
from tfscale._validation import is_int
from tfscale._validation import is_number

_MiB = 1024 * 1024
# What `CommunicationOptions(compression=...)` takes: a 16-bit wire dtype, or
# PowerSGD's low-rank factors.
_COMPRESSIONS = (*collectives.COMPRESSIONS, collectives.powersgd.NAME)
# How long building a strategy waits for the other workers when no collective
# timeout is set.
_STARTUP_BARRIER_SECONDS = 3600


class CommunicationOptions:
    """How `tfscale.Strategy` all-reduces.

    Gradients are packed, last layer first, into buffers of about
    `fusion_threshold_bytes` (tensor fusion); each buffer is all-reduced on
    its own, by the algorithm chosen for it:

    - `"ring"`: one flat ring through all workers. Bandwidth-optimal; its
      2(n-1) latency steps all cross the slowest link.
    - `"hierarchical"`: all-reduce inside each node, all-reduce among the
      node leaders, broadcast inside each node (Jia et al. 2018, 4.2). Fewer
      latency steps, and only one stream per node leaves the node.
    - `"2d"`: all-reduce inside each node, then each worker all-reduces its
      1/k shard with the workers of the same local rank in the other nodes,
      then an all-gather inside the node. Nodes must have equal sizes.
    - `"halving_doubling"`: recursive halving, then recursive doubling, over
      pairs of workers (Thakur, Rabenseifner and Gropp 2005; Goyal et al.
      2017): 2 log2(n) latency steps instead of the ring's 2(n-1), the same
      bytes; any number of workers (2 more steps when n is not a power of
      two).
    - `"hybrid"`: per buffer, `"hierarchical"` below `hybrid_threshold_bytes`
      and `"ring"` at or above it (Jia et al. 2018, 4.3); without a
      threshold, the fastest of ring, hierarchical and halving_doubling by
      `cost_model`'s prediction.

    With one node, or one worker per node, "hierarchical" and "2d" run as a
    ring.
    The plan (each buffer's size and algorithm) is logged once on the chief.

    Args:
        algorithm: `"hybrid"` (default), `"ring"`, `"hierarchical"`, `"2d"`
            or `"halving_doubling"`.
        fusion_threshold_bytes: buffer size at which a fused buffer is closed
            and sent; 0 sends each tensor on its own.
        hybrid_threshold_bytes: `"hybrid"` only: bytes on the wire at which a
            buffer goes by ring instead of hierarchical. `None`: each buffer
            takes the algorithm `cost_model` predicts fastest.
        local_size: workers per node. `None`: workers on the same host in
            TF_CONFIG form a node. Otherwise consecutive workers are grouped
            `local_size` at a time (4 workers on one host with `local_size=2`
            act as 2 nodes of 2); the last node is smaller when it does not
            divide the number of workers.
        compression: `None`, `"bfloat16"`, `"float16"` or `"powersgd"`.
            `"bfloat16"`, `"float16"`: float32 buffers
            travel and are summed in that 16-bit type and come back float32
            (half the bytes; on n workers an error of at most about n * 2**-8
            (bfloat16) or n * 2**-11 (float16) times the sum of the values'
            magnitudes). bfloat16 keeps
            float32's range; float16 is scaled per buffer so its sum cannot
            overflow. Other dtypes, and lone scalars (losses, metrics), travel
            as they are. See
            `tfscale.collectives.compression`.
            `"powersgd"`: each float32 gradient matrix (conv kernels
            reshaped) travels as two rank-`powersgd_rank` factors, with the
            compression error kept on each worker and added to its next
            gradient (Vogels et al. 2019; PyTorch's `powerSGD_hook`); see
            `tfscale.collectives.powersgd`. Its state is saved per worker by
            `tfscale.checkpoint` (and so by tfscale's backup callbacks).
        timeout_seconds: a collective that has not completed after this many
            seconds fails, so a lost worker stops its peers instead of leaving
            them waiting forever. It must exceed the longest time one worker
            can legitimately run ahead of the others (the chief writing a
            checkpoint or an export, a slow first step while graphs are
            built); `None` waits forever, as stock MWMS does.
        cost_model: a `tfscale.collectives.cost_model.CostModel` for the
            hybrid threshold and for how many chunks the hierarchical
            algorithms pipeline; `None`: its `DEFAULT`. Fit one to your
            cluster with `cost_model.fit`.
        time_all_reduces: add each all-reduce's exposed time to
            `Strategy.exposed_communication_seconds` (two timestamps per
            all-reduce). `False` leaves the all-reduces untimed, so nothing
            waits for every input of a batch before its result is stamped.
            Steps compiled by XLA (`jit_compile=True`) are never timed: XLA
            has no kernel for `tf.timestamp`.
        powersgd_rank: `compression="powersgd"` only: the rank r of the
            factors (PyTorch's `matrix_approximation_rank`); default 4.
        powersgd_start_step: `compression="powersgd"` only: optimizer
            updates all-reduced uncompressed before compression starts
            (PyTorch's `start_powerSGD_iter`); default 10.
        powersgd_min_compression_rate: `compression="powersgd"` only: a
            matrix is compressed only if it shrinks at least this many times,
            else it is all-reduced as it is (PyTorch's
            `min_compression_rate`); default 2.
        implementation: what carries the collectives, in TensorFlow's names:
            `"auto"` (default): NCCL when the worker's device is a GPU, ring
            otherwise; `"ring"`: TensorFlow's ring over gRPC everywhere;
            `"nccl"`: NCCL (`communication_hint="nccl"`) under every stage,
            refused here when TensorFlow sees no GPU. Through NCCL every
            collective of a worker is chained in one order that all workers
            share (NCCL communicators of a GPU share one stream: collectives
            of different groups launched in different orders can deadlock);
            broadcasts become all-reduces to which only the sender
            contributes (broadcasts take no ordering token); "bfloat16"
            compression travels as "float16" with its per-buffer scale (NCCL
            has no bfloat16); hierarchical and 2d buckets go whole, not in
            chunks. `Strategy.communication_implementation` says what was
            chosen. See `tfscale.collectives.implementation`. The NCCL path
            has been traced and checked on CPU, not run on a GPU by tfscale's
            tests; `tfscale-bench gpucheck` checks it on your GPUs.
    """

    def __init__(
        self,
        algorithm="hybrid",
        fusion_threshold_bytes=32 * _MiB,
        hybrid_threshold_bytes=None,
        local_size=None,
        compression=None,
        timeout_seconds=300,
        cost_model=None,
        time_all_reduces=True,
        powersgd_rank=None,
        powersgd_start_step=None,
        powersgd_min_compression_rate=None,
        implementation="auto",
    ):
        collectives.implementation.check_implementation(
            implementation,
            num_gpus=(len(tf.config.list_physical_devices("GPU"))
                      if implementation == "nccl" else None))
        if algorithm not in collectives.ALGORITHMS:
            raise ValueError(
                f"Argument `algorithm` must be one of {list(collectives.ALGORITHMS)}. "
                f"Received: algorithm={algorithm!r}"
            )
        if not is_int(fusion_threshold_bytes) or fusion_threshold_bytes < 0:
            raise ValueError(
                "Argument `fusion_threshold_bytes` must be an integer >= 0. "
                f"Received: fusion_threshold_bytes={fusion_threshold_bytes!r}"
            )
        if hybrid_threshold_bytes is not None:
            if not is_int(hybrid_threshold_bytes) or hybrid_threshold_bytes < 0:
                raise ValueError(
                    "Argument `hybrid_threshold_bytes` must be an integer >= 0, "
                    "or None to take it from the cost model. "
                    f"Received: hybrid_threshold_bytes={hybrid_threshold_bytes!r}"
                )
            if algorithm != "hybrid":
                raise ValueError(
                    "Argument `hybrid_threshold_bytes` only applies to "
                    f"algorithm='hybrid'; this is algorithm={algorithm!r}. "
                    f"Received: hybrid_threshold_bytes={hybrid_threshold_bytes!r}"
                )
        if local_size is not None and (not is_int(local_size) or local_size < 1):
            raise ValueError(
                "Argument `local_size` must be an integer >= 1 (workers per "
                "node), or None to group workers by host. "
                f"Received: local_size={local_size!r}"
            )
        if compression is not None and compression not in _COMPRESSIONS:
            raise ValueError(
                "Argument `compression` must be None or one of "
                f"{list(_COMPRESSIONS)}. "
                f"Received: compression={compression!r}"
            )
        powersgd = _check_powersgd(compression, powersgd_rank, powersgd_start_step,
                                   powersgd_min_compression_rate)
        if timeout_seconds is not None and (
            not is_number(timeout_seconds) or timeout_seconds <= 0
        ):
            raise ValueError(
                "Argument `timeout_seconds` must be a number > 0, or None to "
                f"wait forever. Received: timeout_seconds={timeout_seconds!r}"
            )
        if cost_model is not None and not isinstance(
            cost_model, collectives.cost_model.CostModel
        ):
            raise TypeError(
                "Argument `cost_model` must be a "
                "`tfscale.collectives.cost_model.CostModel` or None. "
                f"Received: cost_model={cost_model!r}"
            )
        self.algorithm = algorithm
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.hybrid_threshold_bytes = hybrid_threshold_bytes
        self.local_size = local_size
        self.compression = compression
        if not isinstance(time_all_reduces, bool):
            raise TypeError(
                "Argument `time_all_reduces` must be True or False. "
                f"Received: time_all_reduces={time_all_reduces!r}"
            )
        self.timeout_seconds = timeout_seconds
        self.cost_model = cost_model
        self.time_all_reduces = time_all_reduces
        (self.powersgd_rank, self.powersgd_start_step,
         self.powersgd_min_compression_rate) = powersgd
        self.implementation = implementation

    def get_config(self):
        return {
            "algorithm": self.algorithm,
            "fusion_threshold_bytes": self.fusion_threshold_bytes,
            "hybrid_threshold_bytes": self.hybrid_threshold_bytes,
            "local_size": self.local_size,
            "compression": self.compression,
            "timeout_seconds": self.timeout_seconds,
            "cost_model": (
                None if self.cost_model is None else self.cost_model.get_config()
            ),
            "time_all_reduces": self.time_all_reduces,
            "powersgd_rank": self.powersgd_rank,
            "powersgd_start_step": self.powersgd_start_step,
            "powersgd_min_compression_rate": self.powersgd_min_compression_rate,
            "implementation": self.implementation,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.get("cost_model") is not None:
            config["cost_model"] = collectives.cost_model.CostModel.from_config(
                config["cost_model"]
            )
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"CommunicationOptions({args})"

    def __eq__(self, other):
        return (
            isinstance(other, CommunicationOptions)
            and self.get_config() == other.get_config()
        )


class KerasMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """Stock MultiWorkerMirroredStrategy with only the Keras 3 `fit` fixes.

    The fixes: `reduce` takes what Keras 3 hands it, and all-reduces run inside
    Keras's `steps_per_execution > 1` loop (`loop_instance_keys`).

    Gradients take TensorFlow's own all-reduce, packed as
    `communication_options` says. This is the baseline tfscale's benchmarks
    compare against, and the base of `tfscale.Strategy`, which adds its own
    all-reduce. One replica per worker process, as with Horovod. With two or
    more workers, `fit` refuses `keras.callbacks.BackupAndRestore` (use
    `tfscale.callbacks.BackupAndRestore`) and lets only the chief write where
    `ModelCheckpoint`, `TensorBoard` and `CSVLogger` are told to
    (`tfscale.keras_callbacks`). `jit_compile=True` on two or more CPU
    workers is refused in one line (`tfscale.jit_compile`).

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`;
            defaults to TF_CONFIG.
        communication_options: a `tf.distribute.experimental.CommunicationOptions`.
        time_all_reduces: add each all-reduce's exposed time to
            `exposed_communication_seconds`.
        startup_timeout_seconds: how long the first strategy of a process
            waits for the other workers to start before it raises
            `tfscale.StartupError` naming them; `None` waits as long as it
            takes. See `tfscale.startup.wait_for_peers`.
        barrier_timeout_seconds: how long a later strategy waits for every
            worker to build it; default: `communication_options`' timeout,
            else an hour.
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 time_all_reduces=False,
                 startup_timeout_seconds=startup.DEFAULT_TIMEOUT_SECONDS,
                 barrier_timeout_seconds=None):
        _check_startup_timeout(startup_timeout_seconds)
        _tf_private.check_versions()
        if evaluator.is_evaluator_task(cluster_resolver):
            raise ValueError(
                "This process is an `evaluator` task of its cluster, which "
                "takes no part in training (TensorFlow's definition): do not "
                "build a strategy there; evaluate the training job's "
                "checkpoints with `tfscale.evaluator.CheckpointEvaluator`.")
        # Keras's BackupAndRestore refused, its file writers chief-only.
        keras_callbacks.install()
        # Keras builds the model from this worker's first batch, not from a
        # cross-worker mean that fails on batches of different sizes.
        _tf_private.route_symbolic_build(_is_keras_multi_worker_strategy)
        jit_compile.install()  # refused on 2+ CPU workers, in one line
        number = _tf_private.take_collective_keys(self)
        timeout = (barrier_timeout_seconds
                   or getattr(communication_options, "timeout_seconds", None)
                   or _STARTUP_BARRIER_SECONDS)
        if cluster_resolver is None:  # what MWMS would build
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        if not _tf_private.cluster_connected():
            # TensorFlow's own wait for the peers can be neither watched nor
            # interrupted (tfscale.startup); tfscale's can.
            startup.wait_for_peers(
                cluster_resolver.cluster_spec().as_dict(),
                cluster_resolver.task_type, cluster_resolver.task_id,
                startup_timeout_seconds)
        # Nothing may run TensorFlow ops in another thread while the
        # collective runtime is re-created (`tfscale.collectives.watchdog`).
        collectives.watchdog.stop_all()
        # A later strategy replaces this worker's collective executor: no
        # peer may still be running collectives of the previous one, nor
        # start the new one's, while it does.
        _tf_private.wait_for_all_workers(f"tfscale strategy {number}: start", timeout)
        super().__init__(
            cluster_resolver=cluster_resolver,
            communication_options=communication_options,
        )
        _tf_private.wait_for_all_workers(f"tfscale strategy {number}: ready", timeout)
        devices = _tf_private.local_devices(self)
        if len(devices) > 1:
            raise ValueError(
                "tfscale runs one replica per worker process, as Horovod runs "
                "one process per GPU, but this worker sees several devices. "
                "Start one worker per device and limit each to its own, e.g. "
                f"with CUDA_VISIBLE_DEVICES. Received: devices={devices}"
            )
        self._exposed_communication_seconds = None
        if time_all_reduces:
            with tf.device(devices[0]):
                self._exposed_communication_seconds = tf.Variable(
                    0.0, dtype=tf.float64, trainable=False,
                    name="exposed_communication_seconds",
                )
        self._install_all_reduce()

    def _install_all_reduce(self):
        """Routes the all-reduces; here: TensorFlow's own, timed if asked.

        Either way their collectives also work inside Keras's
        `steps_per_execution` loop (see `loop_instance_keys`).
        """
        _tf_private.install_stock_cross_device_ops(
            self, self._exposed_communication_seconds)

    @property
    def loop_instance_keys(self):
        """Collective instance keys fixed when traced, not at each call.

        Keras's `steps_per_execution > 1` runs each step's all-reduces inside
        a `tf.while_loop`, where TensorFlow cannot feed the fresh key it
        otherwise gives each call (stock MWMS fails there with 2+ workers:
        `You must feed a value for placeholder tensor 'while/cond/Placeholder'`).
        Those all-reduces take a key when traced, listed here; empty with one
        worker or `steps_per_execution=1`.
        """
        return _tf_private.loop_instance_keys(self)

    @property
    def exposed_communication_seconds(self):
        """Seconds this worker has waited on all-reduces, in total, or `None`.

        A float64 `tf.Variable` (`None` unless all-reduces are timed) to which
        every all-reduce (gradients, and the scalars Keras and the loss scale
        reduce) adds the time from its last input being ready to its last
        result being ready: the communication not hidden behind computing
        those inputs, plus any wait for slower workers. The difference of two
        readings around a step is that step's exposed communication;
        `tfscale.callbacks.TensorBoardScalars` writes it per step.
        """
        return self._exposed_communication_seconds

    @property
    def num_workers(self):
        """Number of worker processes training together."""
        return self.num_replicas_in_sync

    @property
    def worker_index(self):
        """This worker's rank among the training tasks, chief first (0 alone).

        As TensorFlow numbers replicas: with a `chief` job in TF_CONFIG (as
        Kubeflow's TFJob writes it) the chief is 0 and `worker` i is i + 1;
        without one, `worker` i is i.
        """
        resolver = self.cluster_resolver
        return collectives.topology.rank_in_cluster(
            _tf_private.cluster_spec_dict(self), resolver.task_type,
            resolver.task_id or 0)

    @property
    def is_chief(self):
        """Whether this worker logs, checkpoints and exports: the `chief` task
        when TF_CONFIG has one, else worker 0 (TensorFlow's definition)."""
        return self.worker_index == 0

    def reduce(self, reduce_op, value, axis=None):
        """`tf.distribute.Strategy.reduce`, mapped over nests.

        Keras 3 reduces a whole data batch (a nest) to build the model and
        reduces scalar metrics with `axis=0`; multi-worker MWMS rejects both
        (keras-team/keras#20585, tensorflow/tensorflow#72388). Rank-0 values
        are reduced across replicas only.
        """
        parent_reduce = super().reduce

        def reduce_one(v):
            rank = _rank(v)
            return parent_reduce(
                reduce_op, v, axis=None if rank == 0 else axis
            )

        return tf.nest.map_structure(reduce_one, value)


class Strategy(KerasMultiWorkerMirroredStrategy):
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

    Several strategies may be built one after another in one process (every
    worker in the same order); each takes collective keys of its own.

    Mixed precision as Keras's guide teaches it
    (https://keras.io/guides/mixed_precision/ ; Micikevicius et al. 2018,
    https://arxiv.org/abs/1710.03740) works unchanged: with
    `keras.mixed_precision.set_global_policy("mixed_float16")`, `compile`
    inside `strategy.scope()` wraps a plain optimizer in
    `tfscale.optimizers.LossScaleOptimizer` where Keras would use its own
    `keras.optimizers.LossScaleOptimizer`. Keras's decides from each worker's
    LOCAL gradients whether to skip a step; when only one worker overflows
    (routine early in float16 training) the workers take different branches
    around the gradient all-reduce and hang until the collective timeout.
    tfscale's sums a non-finite flag over all workers first, so all skip
    together and halve the scale together. An optimizer that already is a
    `LossScaleOptimizer` is left as given: wrap it in tfscale's yourself in a
    custom training loop.

    Keras's gradient clipping and accumulation arguments work on any Keras
    optimizer (`tfscale.optimizers.LARS` too) and mean what they mean on one
    worker: the gradients are all-reduced first, then `clipnorm`,
    `global_clipnorm` or `clipvalue` clip the all-reduced gradient (Keras
    alone clips each worker's local one). `gradient_accumulation_steps=k`
    adds k local micro-batch gradients without communicating and
    all-reduces their sum once (Keras alone fails there under
    MultiWorkerMirroredStrategy, in `merge_call`): k micro-batches of b per
    worker train as one step of k*b does. Keras's learning-rate schedules
    count micro-batches; wrap one in `tfscale.schedules.PerAccumulatedStep`
    to count updates.

    Args:
        communication: a `tfscale.CommunicationOptions`; defaults to its
            defaults.
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            (for example `SlurmClusterResolver`); defaults to TF_CONFIG.
        startup_timeout_seconds: how long to wait for the other workers to
            start (a pod not scheduled yet) before raising
            `tfscale.StartupError` naming them; meanwhile the missing ones are
            logged every 30 s, and SIGINT or SIGTERM stops the wait (also with
            `StartupError`). `None` waits as long as it takes. Only the first
            strategy of a process waits.
    """

    def __init__(self, communication=None, cluster_resolver=None,
                 startup_timeout_seconds=startup.DEFAULT_TIMEOUT_SECONDS):
        if communication is None:
            communication = CommunicationOptions()
        if not isinstance(communication, CommunicationOptions):
            raise TypeError(
                "Argument `communication` must be a "
                "`tfscale.CommunicationOptions`. "
                f"Received: communication={communication!r}"
            )
        self.communication = communication
        super().__init__(
            cluster_resolver=cluster_resolver,
            # TensorFlow's own collectives here (variable creation, gathers)
            # take no timeout: each timed one would hold a thread for all of
            # it (see `tfscale.collectives.watchdog`).
            communication_options=tf.distribute.experimental.CommunicationOptions(),
            barrier_timeout_seconds=communication.timeout_seconds,
            time_all_reduces=communication.time_all_reduces,
            startup_timeout_seconds=startup_timeout_seconds,
        )
        if self.is_chief:
            logging.info(
                "tfscale.Strategy: %s; %s; collectives through %s.",
                self._topology.describe(), communication, self._implementation,
            )
        self._powersgd = None
        if communication.compression == collectives.powersgd.NAME:
            self._powersgd = collectives.powersgd.PowerSGD(
                self._sum_over_workers, self.num_workers,
                rank=communication.powersgd_rank,
                start_step=communication.powersgd_start_step,
                min_compression_rate=communication.powersgd_min_compression_rate,
                log_plans=self.is_chief)
        _tf_private.route_compile_loss_scaling(_compile_loss_scale_class)
        # Each worker's loss weighted by its share of the step's examples
        # (see `run`).
        _tf_private.route_loss_scaling(uneven_data.scale_loss,
                                       uneven_data.unscale_loss)
        self._on_cpu = all(
            tf.DeviceSpec.from_string(d).device_type == "CPU"
            for d in _tf_private.local_devices(self))
        # Clipping and accumulation of every Keras optimizer on the
        # all-reduced gradient (see `_routes_optimizer_updates`).
        _tf_private.route_optimizer_updates(_routes_optimizer_updates)

    def _install_all_reduce(self):
        """Routes dense all-reduces through tfscale's fused collectives."""
        communication = self.communication
        cluster_spec = _tf_private.cluster_spec_dict(self)
        self._topology = collectives.topology.from_cluster_spec(
            cluster_spec, rank=self.worker_index,
            local_size=communication.local_size,
        )
        if self._topology.num_workers != self.num_replicas_in_sync:
            raise ValueError(
                f"The cluster spec lists {self._topology.num_workers} chief/worker "
                f"tasks but {self.num_replicas_in_sync} replicas are in sync; "
                "tfscale needs one replica per chief/worker task. "
                f"Received: cluster_spec={cluster_spec!r}"
            )
        self._implementation = collectives.implementation.resolve(
            communication.implementation, _tf_private.local_devices(self)[0])
        self._all_reduce = collectives.AllReduce(
            self._topology,
            algorithm=communication.algorithm,
            fusion_threshold_bytes=communication.fusion_threshold_bytes,
            hybrid_threshold_bytes=communication.hybrid_threshold_bytes,
            # PowerSGD sends float32 factors through this all-reduce.
            compression=(None if communication.compression == collectives.powersgd.NAME
                         else communication.compression),
            cost_model=communication.cost_model,
            log_plans=self.is_chief,
            exposed_communication_seconds=self._exposed_communication_seconds,
            implementation=self._implementation,
        )
        # tfscale's collectives keep the timeout with one thread, not one
        # per collective.
        self._watchdog = None
        if communication.timeout_seconds is not None:
            self._watchdog = collectives.watchdog.Watchdog(
                communication.timeout_seconds, _tf_private.local_devices(self)[0],
                _tf_private.abort_collectives)
        self._routed_ops = _tf_private.install_cross_device_ops(
            self, self._all_reduce, timeout_seconds=None,
            implementation=self._implementation, watch=self._watchdog,
        )

    def run(self, fn, args=(), kwargs=None, options=None):
        """`tf.distribute.Strategy.run`, with each worker's loss weighted by
        its share of the batch's examples.

        Keras's train and test steps, and custom training loops, call it with
        this worker's part of a global batch (a `DistributedValues` from a
        distributed dataset; plain tensors, the same on every worker, are no
        batch and keep Keras's scaling). The parts differ in size when
        the global batch does not divide among the workers, when it is the
        partial last one, or when a worker has run out of data (it then gets
        an empty batch and still joins every collective). Inside `fn` Keras
        scales each worker's loss by `n_w / n`, its examples over the step's
        examples on all workers, instead of `1 / num_workers`, so the summed
        gradient is the mean over the examples that took part, as on one
        worker (`tfscale.uneven_data`).
        """
        if self.num_workers > 1 and _holds_a_batch(args, kwargs):
            keras_step = _tf_private.keras_step(fn)
            fn = uneven_data.counting_examples(
                fn, keras_step=keras_step,
                model=getattr(fn, "__self__", None) if keras_step else None,
                on_cpu=self._on_cpu)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """`tf.distribute.Strategy.distribute_datasets_from_function`, with
        the workers agreeing on how many batches there are.

        TensorFlow takes each worker's own pipeline's length as the number
        of batches; Keras then runs that many steps, and workers whose
        pipelines differ in length issue different collectives and fail.
        The workers agree on the longest (one all-gather, here); those that
        run out first get empty batches until the last one is done
        (`tfscale.uneven_data`).
        """
        distributed = super().distribute_datasets_from_function(
            dataset_fn, options=options)
        if self.num_workers > 1:
            mine = _tf_private.cardinality(distributed)
            everyone = self.gather(self.experimental_distribute_values_from_function(
                lambda _: tf.constant([mine], tf.int64)), axis=0)
            agreed = uneven_data.agreed_cardinality(everyone.numpy())
            if agreed is not None:
                _tf_private.set_cardinality(distributed, agreed)
        return distributed

    def _sum_over_workers(self, tensors):
        """Sums `tensors` over all workers, fused as any all-reduce, with no
        `merge_call` (PowerSGD calls it inside `tf.cond`)."""
        if self.num_workers == 1:
            return list(tensors)
        return self._all_reduce(list(tensors), self.collective_group)

    @property
    def powersgd(self):
        """The `tfscale.collectives.powersgd.PowerSGD` that all-reduces the
        gradients of every Keras optimizer under this strategy, or `None`
        unless `compression="powersgd"`."""
        return self._powersgd

    def worker_state(self, model):
        """This worker's own training state for `model`, or `None`.

        State that differs between workers, so that the chief's checkpoint
        cannot hold it: PowerSGD's error feedback (with its Q), as a
        `tf.Module`; `None` unless `compression="powersgd"` or before
        `compile`. Created on first use (on every worker at the same point:
        creating variables is a collective).
        `tfscale.checkpoint` saves and restores it on every worker.
        """
        if self._powersgd is None or model.optimizer is None:
            return None
        with self.scope():
            return self._powersgd.state(model.optimizer, model.trainable_variables)

    @property
    def communication_implementation(self):
        """`"nccl"` or `"ring"`: what carries tfscale's collectives on this
        worker (`CommunicationOptions.implementation`, "auto" resolved on the
        worker's device)."""
        return self._implementation

    @property
    def topology(self):
        """The `tfscale.collectives.topology.Topology`: nodes, this worker's rank."""
        return self._topology

    @property
    def collective_group(self):
        """This worker's `CollectiveGroup` of all workers, for custom collectives.

        Its `all_reduce`, `all_gather`, `broadcast_send`/`broadcast_recv` and
        `subgroup` issue TensorFlow collectives with this strategy's keys and
        timeout; every worker must issue the same ones in the same order.
        """
        return self._routed_ops.groups[0]

    @property
    def collective_groups(self):
        """The `tfscale.collectives.Groups` (all workers, the in-node and
        cross-node sub-groups of the topology, and the pairs of
        halving-doubling) the algorithms run on."""
        return self._all_reduce.groups(self.collective_group)

    def all_reduce_plan(self, tensors):
        """The fused buckets (`tfscale.collectives.Bucket`) this strategy
        all-reduces `tensors` (given in forward order) in."""
        return self._all_reduce.plan(tensors)

    @property
    def all_reduce_batch_sizes(self):
        """Number of tensors in each dense batch routed through tfscale's
        all-reduce, recorded when traced (shows that Keras uses the hook)."""
        return list(self._routed_ops.routed_batch_sizes)


def _compile_loss_scale_class():
    """The loss-scale class `Model.compile` wraps its optimizer in under
    `mixed_float16`: tfscale's under a `tfscale.Strategy` (decided, as Keras's
    optimizers capture their strategy, by the strategy in scope when compile
    builds it), Keras's own elsewhere (stock strategies, no strategy)."""
    if isinstance(tf.distribute.get_strategy(), Strategy):
        return optimizers.LossScaleOptimizer
    return keras.optimizers.LossScaleOptimizer


def _routes_optimizer_updates(strategy):
    """Whether Keras optimizers under `strategy` (the one running the step)
    all-reduce first, then clip (`clipnorm`, `global_clipnorm`, `clipvalue`)
    and accumulate (`gradient_accumulation_steps`, one all-reduce per
    accumulated step): under a `tfscale.Strategy`. Elsewhere Keras clips each
    worker's local gradient, and accumulation fails under
    MultiWorkerMirroredStrategy."""
    return isinstance(strategy, Strategy)


def _holds_a_batch(args, kwargs):
    """Whether `strategy.run`'s arguments hold per-worker values (a batch of
    a distributed dataset)."""
    return any(isinstance(value, tf.distribute.DistributedValues)
               for value in tf.nest.flatten((args, kwargs or {})))


def _is_keras_multi_worker_strategy(strategy):
    return isinstance(strategy, KerasMultiWorkerMirroredStrategy)


def _check_powersgd(compression, rank, start_step, min_compression_rate):
    """`(rank, start_step, min_compression_rate)`, defaults filled in under
    PowerSGD, all `None` otherwise; raises on a bad or misplaced value."""
    given = {"powersgd_rank": rank, "powersgd_start_step": start_step,
             "powersgd_min_compression_rate": min_compression_rate}
    if compression != collectives.powersgd.NAME:
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"Argument `{name}` only applies to compression='powersgd'; "
                    f"this is compression={compression!r}. Received: {name}={value!r}")
        return None, None, None
    if rank is None:
        rank = collectives.powersgd.DEFAULT_RANK
    if start_step is None:
        start_step = collectives.powersgd.DEFAULT_START_STEP
    if min_compression_rate is None:
        min_compression_rate = collectives.powersgd.DEFAULT_MIN_COMPRESSION_RATE
    if not is_int(rank) or rank < 1:
        raise ValueError("Argument `powersgd_rank` must be an integer >= 1 (the "
                         f"rank of the factors). Received: powersgd_rank={rank!r}")
    if not is_int(start_step) or start_step < 0:
        raise ValueError(
            "Argument `powersgd_start_step` must be an integer >= 0 (optimizer "
            "updates all-reduced uncompressed before PowerSGD starts). "
            f"Received: powersgd_start_step={start_step!r}")
    if not is_number(min_compression_rate) or min_compression_rate < 1:
        raise ValueError(
            "Argument `powersgd_min_compression_rate` must be a number >= 1 (a "
            "matrix is compressed only if it shrinks at least this many times). "
            f"Received: powersgd_min_compression_rate={min_compression_rate!r}")
    return rank, start_step, float(min_compression_rate)


def _check_startup_timeout(value):
    if value is not None and (not is_number(value) or value <= 0):
        raise ValueError(
            "Argument `startup_timeout_seconds` must be a number > 0, or None "
            f"to wait as long as it takes. Received: startup_timeout_seconds={value!r}"
        )


def _rank(value):
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    return tf.convert_to_tensor(value).shape.rank
