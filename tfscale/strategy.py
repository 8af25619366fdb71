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

import atexit
import contextlib
import os
import socket
import sys

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfscale import _version
from tfscale import agreement
from tfscale._private import accessors
from tfscale._private import graph_order
from tfscale._private import hooks
from tfscale._private import host_input
from tfscale._private import keras_hooks
from tfscale._private import tf_collectives
from tfscale import collectives
from tfscale import evaluator
from tfscale import preemption
from tfscale import uneven_data
from tfscale import fit_hooks
from tfscale import optimizers
from tfscale import startup
from tfscale import timeline
from tfscale import variable_creation
from tfscale._validation import is_finite_number
from tfscale._validation import is_number
from tfscale.collectives.options import CommunicationOptions

# How long a later strategy waits at its start barrier for the other workers
# to build it, by default: they may still be in a long fit or evaluate.
_STARTUP_BARRIER_SECONDS = 3600


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
    (`tfscale.fit_hooks`). `jit_compile=True` on two or more CPU
    workers is refused in one line (also `tfscale.fit_hooks`).

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
            worker to build it; default: an hour. Not the collective
            timeout: a peer may still be in a long `fit` or `evaluate`
            when this worker gets here.
        heartbeat_timeout_seconds: after how long without a heartbeat
            TensorFlow's coordination service takes a worker for lost and
            stops the job (each heartbeat may take half of it to be
            answered). The same on every worker; set by the first strategy
            of a process.
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 time_all_reduces=False,
                 startup_timeout_seconds=startup.DEFAULT_TIMEOUT_SECONDS,
                 barrier_timeout_seconds=None,
                 heartbeat_timeout_seconds=startup.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS):
        _check_startup_timeout(startup_timeout_seconds)
        _check_heartbeat_timeout(heartbeat_timeout_seconds)
        # Every private TensorFlow/Keras hook in place, before anything runs.
        hooks.check(_version.is_tested, _version.tested())
        if evaluator.is_evaluator_task(cluster_resolver):
            raise ValueError(
                "This process is an `evaluator` task of its cluster, which "
                "takes no part in training (TensorFlow's definition): do not "
                "build a strategy there; evaluate the training job's "
                "checkpoints with `tfscale.evaluator.CheckpointEvaluator`.")
        # Keras's BackupAndRestore refused, its file writers chief-only,
        # jit_compile refused on 2+ CPU workers (`tfscale.fit_hooks`).
        fit_hooks.install(_is_keras_multi_worker_strategy)
        # Keras builds the model from this worker's first batch, not from a
        # cross-worker mean that fails on batches of different sizes.
        keras_hooks.route_symbolic_build(_is_keras_multi_worker_strategy)
        # A user's tf.function that calls tfscale traces its code as written.
        graph_order.trace_unconverted("tfscale")
        number = tf_collectives.take_collective_keys(
            self, collectives.topology.MAX_SUBGROUP_INDEX)
        timeout = barrier_timeout_seconds or _STARTUP_BARRIER_SECONDS
        if cluster_resolver is None:  # what MWMS would build
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        if not tf_collectives.cluster_connected():
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
        tf_collectives.wait_for_all_workers(f"tfscale strategy {number}: start", timeout)
        with tf_collectives.heartbeats_configured(
                cluster_resolver, heartbeat_timeout_seconds) as in_force:
            if in_force is not None and in_force != heartbeat_timeout_seconds:
                logging.warning(
                    "tfscale: heartbeat_timeout_seconds=%g is not applied: this "
                    "process's coordination service runs with %g s, set when its "
                    "first strategy was built.", heartbeat_timeout_seconds, in_force)
            super().__init__(
                cluster_resolver=cluster_resolver,
                communication_options=communication_options,
            )
        tf_collectives.wait_for_all_workers(f"tfscale strategy {number}: ready", timeout)
        devices = accessors.local_devices(self)
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
        seconds = self._exposed_communication_seconds
        tf_collectives.install_stock_cross_device_ops(
            self, wrap=None if seconds is None else (
                lambda reduce, value: collectives.timed_all_reduce(reduce, value, seconds)))

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
        return tf_collectives.loop_instance_keys(self)

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
            accessors.cluster_spec_dict(self), resolver.task_type,
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
        heartbeat_timeout_seconds: after how long without a heartbeat
            TensorFlow's coordination service takes a worker for lost and
            stops the job; each heartbeat may take half of it to be
            answered, behind the tensors on a busy link (docs/failures.md).
            The same on every worker; set by the first strategy of a
            process.
    """

    def __init__(self, communication=None, cluster_resolver=None,
                 startup_timeout_seconds=startup.DEFAULT_TIMEOUT_SECONDS,
                 heartbeat_timeout_seconds=startup.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS):
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
            time_all_reduces=communication.time_all_reduces,
            startup_timeout_seconds=startup_timeout_seconds,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
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
                rank=communication.powersgd.rank,
                start_step=communication.powersgd.start_step,
                min_compression_rate=communication.powersgd.min_compression_rate,
                log_plans=self.is_chief,
                bucket_bytes=communication.powersgd.bucket_bytes)
        keras_hooks.route_compile_loss_scaling(_compile_loss_scale_class)
        # Each worker's loss weighted by its share of the step's examples
        # (see `run`).
        keras_hooks.route_loss_scaling(uneven_data.scale_loss,
                                       uneven_data.unscale_loss)
        self._on_cpu = all(
            tf.DeviceSpec.from_string(d).device_type == "CPU"
            for d in accessors.local_devices(self))
        # Clipping and accumulation of every Keras optimizer on the
        # all-reduced gradient (see `_gradient_reducer`).
        keras_hooks.route_optimizer_updates(_gradient_reducer)
        self._preemption = preemption.PreemptionWatch(self.worker_index,
                                                      self.num_workers)
        # A worker whose model differs is named by its variable, and does
        # not wait forever for a broadcast (`tfscale.variable_creation`).
        self._creation_watch = variable_creation.CreationWatch(
            self.worker_index, self.num_workers, communication.timeout_seconds,
            tf_collectives.abort_collectives)
        if communication.timeline is not None:
            _report_at_exit(self._flight_recorder, timeline=(
                communication.timeline,
                collectives.timeline_stamps.clock_offset(self._gather)))

    def _install_all_reduce(self):
        """Routes dense all-reduces through tfscale's fused collectives."""
        communication = self.communication
        cluster_spec = accessors.cluster_spec_dict(self)
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
            communication.implementation, accessors.local_devices(self)[0])
        self._flight_recorder = collectives.flight_recorder.FlightRecorder(
            accessors.local_devices(self)[0], self.worker_index,
            timeline=communication.timeline is not None)
        _report_at_exit(self._flight_recorder)
        self._algorithm = communication.algorithm_on(self._implementation)
        self._all_reduce = collectives.AllReduce(
            self._topology,
            algorithm=self._algorithm,
            fusion_threshold_bytes=communication.fusion_threshold_bytes,
            hybrid_threshold_bytes=communication.hybrid_threshold_bytes,
            # PowerSGD sends float32 factors through this all-reduce.
            compression=(None if communication.compression == collectives.powersgd.NAME
                         else communication.compression),
            cost_model=communication.cost_model,
            log_plans=self.is_chief,
            exposed_communication_seconds=self._exposed_communication_seconds,
            implementation=self._implementation,
            note=self._flight_recorder.context,
            autotuner=(collectives.autotune.AutoTuner(
                accessors.local_devices(self)[0], communication.autotune_dir,
                is_chief=self.is_chief)
                if self._algorithm == collectives.autotune.NAME
                and self._implementation != "nccl" else None),
        )
        # tfscale's collectives keep the timeout with one thread, not one
        # per collective, and are recorded (the flight recorder).
        self._watchdog = None
        if communication.timeout_seconds is not None:
            self._watchdog = collectives.watchdog.Watchdog(
                communication.timeout_seconds, accessors.local_devices(self)[0],
                tf_collectives.abort_collectives, recorder=self._flight_recorder)
        self._routed_ops = tf_collectives.install_cross_device_ops(
            self, self._all_reduce, timeout_seconds=None,
            implementation=self._implementation, watch=self._watchdog,
            max_subgroup_index=collectives.topology.MAX_SUBGROUP_INDEX,
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
            keras_step = keras_hooks.keras_step(fn)
            fn = uneven_data.counting_examples(
                fn, keras_step=keras_step,
                model=getattr(fn, "__self__", None) if keras_step else None,
                on_cpu=self._on_cpu, note=self._flight_recorder.context,
                preemption=self._preemption)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        """`tf.distribute.Strategy.experimental_distribute_dataset`; without
        `options`, a CPU worker reads its batches with a plain iterator
        instead of prefetching them to the device it runs on, its host
        (`tfscale._private.host_input`)."""
        if options is None and self._on_cpu:
            return host_input.distribute_dataset(self, dataset)
        return super().experimental_distribute_dataset(dataset, options=options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """`tf.distribute.Strategy.distribute_datasets_from_function`, with
        the workers agreeing on how many batches there are.

        TensorFlow takes each worker's own pipeline's length as the number
        of batches; Keras then runs that many steps, and workers whose
        pipelines differ in length issue different collectives and fail.
        The workers agree on the longest (one all-gather, here); those that
        run out first get empty batches until the last one is done
        (`tfscale.uneven_data`). Without `options`, a CPU worker reads its
        batches as in `experimental_distribute_dataset`.
        """
        if options is None and self._on_cpu:
            distributed = host_input.distribute_datasets_from_function(self, dataset_fn)
        else:
            distributed = super().distribute_datasets_from_function(
                dataset_fn, options=options)
        if self.num_workers > 1:
            mine = accessors.cardinality(distributed)
            everyone = agreement.gather(self, np.array([mine], np.int64))
            agreed = uneven_data.agreed_cardinality(everyone[:, 0])
            if agreed is not None:
                accessors.set_cardinality(distributed, agreed)
        return distributed

    @contextlib.contextmanager
    def scope(self):
        """`tf.distribute.Strategy.scope`, in which every variable a worker
        creates is watched (`tfscale.variable_creation`)."""
        with super().scope() as scope, tf.variable_creator_scope(self._creation_watch):
            yield scope

    def sum_gradients(self, grads, optimizer, variables):
        """Sums `grads` (of `variables`) over the workers in replica context:
        through PowerSGD under `compression="powersgd"`, else as any dense
        all-reduce."""
        recorder = self._flight_recorder
        with recorder.context(
                step=optimizer.iterations, purpose="gradients",
                variable_names=[v.path for v in variables]):
            recorder.since_step("forward+backward", grads)
            if self._powersgd is not None:
                summed = self._powersgd.all_reduce(
                    list(grads), optimizer, variables, optimizer.iterations)
            else:
                summed = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, list(grads))
            recorder.until_step_end("optimizer update", summed)
            return summed

    def _gather(self, value):
        """Every worker's float `value`, chief first (eager; a collective)."""
        return agreement.gather(self, np.array([value], np.float64))[:, 0]

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
    def flight_recorder(self):
        """The `tfscale.collectives.flight_recorder.FlightRecorder` of this
        worker's collectives (its `records()`, `report()`); it records while
        `CommunicationOptions.timeout_seconds` is set (the default)."""
        return self._flight_recorder

    @property
    def preemption(self):
        """The `tfscale.preemption.PreemptionWatch` of this worker: SIGTERM,
        once `install()`ed (the saving callbacks do), asks every worker to
        save the same step; each step's all-reduce of example counts carries
        the request (`agreed_workers()` between steps)."""
        return self._preemption

    @property
    def communication_algorithm(self):
        """The all-reduce algorithm of this worker's buckets
        (`CommunicationOptions.algorithm`, None resolved for the
        implementation: see `collectives.implementation.default_algorithm`)."""
        return self._algorithm

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

    @property
    def autotune(self):
        """Under `algorithm="auto"` (the default over TensorFlow's ring): the
        `tfscale.collectives.autotune.AutoTuner` whose `choices()` tell each
        all-reduce's trials and choice; else None."""
        return self._all_reduce.autotuner

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


# (recorder, timeline) of the newest strategy: see `_report_at_exit`.
_recorders_at_exit = []


def _report_at_exit(recorder, timeline=None):
    """At exit, the newest strategy's recorder reports if collectives were
    left pending (a failed or hung job), dumps to TFSCALE_FLIGHT_RECORDER,
    and, given `timeline` (its directory, this worker's clock offset from
    the chief's), writes this worker's timeline there (`tfscale.timeline`)."""
    if not _recorders_at_exit:
        atexit.register(_flight_report_at_exit)
    _recorders_at_exit[:] = [(recorder, timeline)]


def _flight_report_at_exit():
    for recorder, timeline_at in _recorders_at_exit:
        try:
            if recorder.pending() and not recorder.reported:
                # The uncaught error that ends the process, if any.
                print(recorder.report("collectives left pending at exit",
                                      error=getattr(sys, "last_value", None)),
                      file=sys.stderr, flush=True)
            directory = os.environ.get(collectives.flight_recorder.DUMP_ENV)
            if directory:
                recorder.dump(directory)
        except Exception as error:  # at exit: say it, never mask the real failure
            print(f"tfscale flight recorder: no report ({error})", file=sys.stderr)
        if timeline_at is not None:
            _write_timeline(recorder, *timeline_at)


def _write_timeline(recorder, directory, clock_offset_seconds):
    """This worker's spans and collectives to `directory`/worker-I.json."""
    try:
        path = timeline.write(
            os.path.join(directory, f"worker-{recorder.worker}.json"),
            timeline.worker_trace(recorder.worker, recorder.stamps.records(),
                                  recorder.records(), clock_offset_seconds,
                                  socket.gethostname()))
        print(f"tfscale timeline: {path}", file=sys.stderr, flush=True)
    except Exception as error:  # at exit: say why, never raise
        print(f"tfscale timeline: not written ({error})", file=sys.stderr)


def _gradient_reducer(strategy):
    """How Keras optimizers under `strategy` (the one running the step) sum
    their gradients over the workers before they clip (`clipnorm`,
    `global_clipnorm`, `clipvalue`) and accumulate
    (`gradient_accumulation_steps`, one all-reduce per accumulated step):
    under a `tfscale.Strategy`, its `sum_gradients`. None elsewhere: Keras
    clips each worker's local gradient, and accumulation fails under
    MultiWorkerMirroredStrategy."""
    return strategy.sum_gradients if isinstance(strategy, Strategy) else None


def _holds_a_batch(args, kwargs):
    """Whether `strategy.run`'s arguments hold per-worker values (a batch of
    a distributed dataset)."""
    return any(isinstance(value, tf.distribute.DistributedValues)
               for value in tf.nest.flatten((args, kwargs or {})))


def _is_keras_multi_worker_strategy(strategy):
    return isinstance(strategy, KerasMultiWorkerMirroredStrategy)


def _check_heartbeat_timeout(value):
    if not is_finite_number(value) or value < 1:
        raise ValueError(
            "Argument `heartbeat_timeout_seconds` must be a number of seconds "
            f">= 1. Received: heartbeat_timeout_seconds={value!r}")


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
