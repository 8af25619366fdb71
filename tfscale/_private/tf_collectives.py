"""TensorFlow's collectives: raw ops over sub-groups, and MWMS's all-reduce
replaced (private APIs; see `tfscale._private`)."""

import contextlib
import itertools

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as tf_cross_device_ops
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import collective_ops
from tensorflow.python.util import nest
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2

# MWMS takes group keys 1, 2, ... for itself (one per device set it reduces
# over); tfscale's own sub-groups start well above them.
_SUBGROUP_KEY_BASE = 1000
# NCCL's types in TensorFlow (`kValidDataTypes`, core/nccl/nccl_manager.cc):
# no bfloat16.
NCCL_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)
_strategies_built = itertools.count()
# The coordination service's heartbeat timeout when none is configured
# (`kDefaultHeartbeatTimeout`, tsl's coordination_service_agent.cc).
TF_HEARTBEAT_TIMEOUT_SECONDS = 10.0


def check_resolved(implementation):
    """Raises ValueError unless `implementation` is "ring" or "nccl" (an
    `implementation="auto"` already resolved on the worker's device)."""
    if implementation not in ("ring", "nccl"):
        raise ValueError(
            "Argument `implementation` must be 'ring' or 'nccl' (resolved "
            f"on the worker's device). Received: implementation={implementation!r}")


def take_collective_keys(strategy, max_subgroup_index):
    """Gives `strategy` group keys that no earlier Strategy of this process used.

    Each Strategy of a process takes MWMS's group keys and those of
    `max_subgroup_index` sub-groups (`CollectiveGroup.subgroup`). TensorFlow
    caches each (group key, instance key) with its shapes, so a second
    Strategy reusing the first one's keys fails with "Shape mismatch in the
    collective instance". Group keys are int32.

    Call it before `MultiWorkerMirroredStrategy.__init__`, which reads the
    base. Every worker builds its strategies in the same order, so the keys
    agree across workers.

    Returns:
        The strategy's number in this process (0 for the first).
    """
    number = next(_strategies_built)
    strategy._collective_key_base = number * (_SUBGROUP_KEY_BASE + max_subgroup_index + 1)
    return number


def wait_for_all_workers(barrier_id, timeout_seconds):
    """Blocks until every chief/worker task has reached `barrier_id`.

    A barrier of TensorFlow's coordination service, which outlives the
    collective executor: each MultiWorkerMirroredStrategy after the first
    re-enables collective ops, which replaces this worker's executor, and a
    peer's collective arriving meanwhile is lost and hangs both. A no-op
    before the first strategy has started the service (and with one worker).
    """
    if not cluster_connected():
        return
    context.context().wait_at_barrier(barrier_id, int(timeout_seconds * 1000))


def cluster_connected():
    """Whether this process has started TensorFlow's coordination service (an
    earlier MultiWorkerMirroredStrategy did): its server then holds this
    worker's port, and its peers have all connected. (Inside
    `heartbeats_configured` the service is configured before it starts.)"""
    return context.context().coordination_service is not None


@contextlib.contextmanager
def heartbeats_configured(cluster_resolver, timeout_seconds):
    """Configures the coordination service that the MultiWorkerMirroredStrategy
    built in the body starts, as MWMS itself would (the leader; the chief and
    worker jobs), with `timeout_seconds` for heartbeats in place of
    TensorFlow's 10 s. MWMS configures the service only when nothing has,
    so build it in the body, and enter only after `wait_for_all_workers`,
    which takes a configured service for a started one. When the body
    raises, the configuration is undone (no service started), so that a
    strategy built again waits for its peers as a first one does.

    Each worker sends a heartbeat every half of its timeout, and a heartbeat
    whose reply takes longer than that stops the worker
    (`StartSendingHeartbeats`, tsl's coordination_service_agent.cc).

    Yields:
        The heartbeat timeout in force in seconds: `timeout_seconds`, or what
        an earlier strategy of this process configured, which stays; None
        where MWMS starts no service (no cluster, or a task outside the
        chief and worker jobs).
    """
    configured = context.context().coordination_service
    if configured is not None:
        yield configured.heartbeat_timeout_in_ms / 1000 or TF_HEARTBEAT_TIMEOUT_SECONDS
        return
    cluster_spec = multi_worker_util.normalize_cluster_spec(
        cluster_resolver.cluster_spec())
    coordinated = [job for job in ("chief", "worker") if job in cluster_spec.jobs]
    if not cluster_spec.as_dict() or cluster_resolver.task_type not in coordinated:
        yield None
        return
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        heartbeat_timeout_in_ms=int(timeout_seconds * 1000),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(
                name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in coordinated])
    try:
        yield timeout_seconds
    except BaseException:
        context.context()._coordination_service_config = None
        raise


def _call_time_key_would_be_lost():
    """Whether a call-time instance key taken now would never be fed.

    `CollectiveReplicaLauncher._next_instance_key` captures the key, at call
    time, in the function graph being traced (skipping `tf.cond`/`tf.while_loop`
    branch graphs, which cannot take such captures). When that function is
    itself called from inside a branch of an enclosing function (Keras's
    `steps_per_execution` loop calls its one-step `tf.function` inside
    `tf.while_loop` -> `tf.cond`), TensorFlow moves the capture onto that
    branch graph (`FuncGraph.capture_call_time_value`'s `wrapped_closure`
    uses the default graph), where `cond_v2`/`while_v2` never feed it: every
    worker fails with `InvalidArgumentError: You must feed a value for
    placeholder tensor 'while/cond/Placeholder'`. One worker never all-reduces,
    so it never takes a key and does not fail.
    """
    if context.executing_eagerly():
        return False
    graph = ops.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    if not graph.building_function:
        return False
    outer = graph.outer_graph
    while outer is not None:
        if getattr(outer, "is_control_flow_graph", False):
            return True
        outer = getattr(outer, "outer_graph", None)
    return False


class _LoopSafeLauncher(cross_device_utils.CollectiveReplicaLauncher):
    """`CollectiveReplicaLauncher` whose collectives also run in Keras's loop.

    With `steps_per_execution > 1` Keras runs its one-step `tf.function`
    inside a `tf.while_loop` (keras/src/backend/tensorflow/trainer.py,
    `multi_step_on_iterator`); TensorFlow's call-time instance keys cannot
    reach collectives there (`_call_time_key_would_be_lost`). Those
    collectives get their key when traced instead, as TensorFlow itself does
    when `CollectiveReplicaLauncher._prefer_unique_instance_key` is off: a
    constant that every execution of the traced function reuses (TensorFlow
    tells the loop's iterations apart by their frame and iteration). Every
    worker traces Keras's functions in the same order, so the keys agree.
    Every other collective keeps its call-time key.

    Args:
        loop_instance_keys: a list to which each key fixed at trace time is
            appended (tests check that this hook is still called).
        *args: `CollectiveReplicaLauncher`'s.
    """

    def __init__(self, *args, loop_instance_keys):
        super().__init__(*args)
        self.loop_instance_keys = loop_instance_keys

    def _next_instance_key(self):
        if self._use_unique_instance_key() and _call_time_key_would_be_lost():
            key = self._collective_keys.get_instance_key(self._group_key, self._device)
            self.loop_instance_keys.append(key)
            return key
        return super()._next_instance_key()


class _LoopSafeCollectiveAllReduce(tf_cross_device_ops.CollectiveAllReduce):
    """MWMS's `CollectiveAllReduce` with `_LoopSafeLauncher`s (Keras's
    `steps_per_execution > 1`); the base of every tfscale `CrossDeviceOps`."""

    def __init__(self, **stock_args):
        super().__init__(**stock_args)
        # Instance keys fixed at trace time, for all of this object's groups.
        self.loop_instance_keys = []
        self._launchers = [
            _LoopSafeLauncher(
                launcher._group_key, launcher._group_size,
                launcher._collective_keys, launcher._device, launcher._options,
                loop_instance_keys=self.loop_instance_keys,
            )
            for launcher in self._launchers
        ]


def loop_instance_keys(strategy):
    """Instance keys fixed at trace time (collectives in Keras's loop)."""
    return list(strategy.extended._cross_device_ops.loop_instance_keys)


class CollectiveGroup:
    """This worker's handle on one group of workers that run collectives.

    Every member must create the same groups and issue the same collectives
    on each group in the same order: instance keys are counted locally, per
    group, and have to agree across members.

    How collectives are ordered depends on `implementation`:

    - `"ring"` (TensorFlow's ring over gRPC, any device): all-reduces and
      all-gathers of one group run in the order they were created (an
      ordering token per group chains them); broadcasts take no token and run
      once their inputs are ready. Collectives of different groups may run
      concurrently, which is what lets the stages of hierarchical all-reduce
      overlap.
    - `"nccl"` (`communication_hint="nccl"`, between GPUs): every collective
      of this group and of all its sub-groups takes ONE ordering token, so
      `tf.function`'s automatic control dependencies chain them in the order
      they were created, across groups. All NCCL communicators of a GPU share
      one stream and an NCCL kernel blocks until every member has launched it
      (core/nccl/nccl_manager.cc, `device_to_comm_streams_`;
      core/nccl/collective_communicator.cc: "We need to synchronize NCCL
      launches across nodes to prevent deadlocks"): every worker issues the
      plan's collectives in the same program order and skips those of groups
      it is not in, so the launch orders of all workers are parts of one
      order. `broadcast_send_v2`/`broadcast_recv_v2` take no ordering token,
      so on this path a broadcast is an all-reduce to which only the sender
      contributes (receivers add zeros): ordered, exact, 2(k-1)/k of the
      buffer per member on a ring. NCCL has no bfloat16: a bfloat16
      all-reduce or broadcast is refused when traced.

    Nothing here checks for a GPU: the NCCL graph can be traced on a CPU
    (`tf.function(...).get_concrete_function()`, not run), which
    tests/test_nccl_graph.py does. `tfscale.Strategy` passes the
    implementation it resolved on the worker's device
    (`tfscale.collectives.implementation.resolve`).

    Args:
        launcher: the `CollectiveReplicaLauncher` (private) that allocates
            instance keys for the group and orders its collectives.
        timeout_seconds: a collective that has not completed by then fails
            instead of waiting forever for a lost peer; `None` waits forever.
        key_base: the strategy's collective key base (see
            `take_collective_keys`); sub-group keys are counted from it.
        implementation: `"ring"` or `"nccl"` (resolved, not "auto").
        ordering: `"nccl"` only: the launcher whose ordering token every
            collective takes (sub-groups get their parent's); `None`: this
            group's own.
        max_subgroup_index: the largest sub-group index (the strategy's key
            range, `take_collective_keys`).
        watch: `fn(issue, inputs, site) -> issue()` that runs each
            collective op (`tfscale.collectives.watchdog.Watchdog`, which
            keeps the timeout without a thread per op, and records it; then
            give `timeout_seconds=None`); `site` describes the op (kind,
            group key and size, dtype, elements). Sub-groups take their
            parent's. `None`: ops run as they are.
    """

    def __init__(self, launcher, timeout_seconds, key_base=0,
                 implementation="ring", ordering=None, watch=None,
                 max_subgroup_index=0):
        check_resolved(implementation)
        self._launcher = launcher
        self._timeout_seconds = timeout_seconds
        self._timeout = timeout_seconds or 0
        self._key_base = key_base
        self._subgroups = {}
        self.implementation = implementation
        # Per group on the ring path; one chain shared with every sub-group
        # on the NCCL path.
        self._ordering = ordering or launcher
        self._watch = watch
        self._max_subgroup_index = max_subgroup_index

    @property
    def size(self):
        return self._launcher._group_size

    @property
    def key(self):
        return self._launcher._group_key

    @property
    def device(self):
        return self._launcher._device

    def ordering_token(self):
        """The resource handle that orders this group's all-reduces and
        all-gathers (shared with every sub-group on the NCCL path)."""
        return self._ordering._get_ordering_token()

    def subgroup(self, index, size):
        """This worker's handle on sub-group number `index` of this group.

        Each distinct set of members needs its own index; every member must
        ask for it with the same index and size. Handles are created once and
        reused: a new handle would restart the group's instance keys.

        Args:
            index: an integer from 1 to the group's `max_subgroup_index`,
                numbering the cluster's sub-groups.
            size: number of workers in the sub-group.

        Returns:
            A `CollectiveGroup` whose group key is the strategy's key base
            plus `_SUBGROUP_KEY_BASE + index`.
        """
        if not 1 <= index <= self._max_subgroup_index:
            raise ValueError(
                "Argument `index` must be in 1.."
                f"{self._max_subgroup_index}. Received: index={index!r}"
            )
        if index in self._subgroups:
            group = self._subgroups[index]
            if group.size != size:
                raise ValueError(
                    f"Sub-group {index} has {group.size} workers; it cannot "
                    f"be reused with size={size}."
                )
            return group
        key = self._key_base + _SUBGROUP_KEY_BASE + index
        # A CollectiveKeys of its own whose first group key is `key`: it
        # registers the key for this device and counts its instance keys.
        keys = cross_device_utils.CollectiveKeys(group_key_start=key)
        assert keys.get_group_key([self.device]) == key
        launcher = _LoopSafeLauncher(
            key, size, keys, self.device, self._launcher._options,
            loop_instance_keys=self._launcher.loop_instance_keys,
        )
        group = CollectiveGroup(
            launcher, self._timeout_seconds, self._key_base, self.implementation,
            ordering=self._ordering if self.implementation == "nccl" else None,
            watch=self._watch, max_subgroup_index=self._max_subgroup_index)
        self._subgroups[index] = group
        return group

    def _call_args(self, ordered=True):
        args = dict(
            group_size=self.size,
            group_key=self.key,
            instance_key=self._launcher._next_instance_key(),
            timeout=self._timeout,
        )
        if ordered:
            args["ordering_token"] = self.ordering_token()
        return args

    def all_reduce(self, tensor, merge_op="Add"):
        """Element-wise sum (or `merge_op="Max"`) of `tensor` over the group.

        Ring: float32, float16, bfloat16, float64, int32 and int64. NCCL:
        the same but bfloat16.
        """
        if self.implementation == "nccl":
            _check_nccl_dtype(tensor.dtype)
        with tf.device(self.device):
            return self._issue(lambda: collective_ops.all_reduce_v2(
                tensor, merge_op=merge_op, communication_hint=self.implementation,
                **self._call_args(),
            ), [tensor], "all_reduce" if merge_op == "Add" else f"all_reduce_{merge_op.lower()}")

    def _issue(self, op, inputs, kind):
        """`op()`, through `watch` if given, described as `kind`."""
        if self._watch is None:
            return op()
        site = {"op": kind, "group": int(self.key), "group_size": int(self.size)}
        if inputs:
            site.update(dtype=inputs[0].dtype.name,
                        elements=inputs[0].shape.num_elements())
        return self._watch(op, inputs, site)

    def all_gather(self, tensor):
        """Concatenates every member's `tensor` along axis 0.

        Members are ordered by TensorFlow's device-name ranking, which need
        not be the order of their ranks: callers that care must tag the
        pieces (see `algorithms.two_d_all_reduce`).
        """
        with tf.device(self.device):
            wire, dtype = _as_copyable(tensor)
            gathered = self._issue(lambda: collective_ops.all_gather_v2(
                wire, communication_hint=self.implementation, **self._call_args()
            ), [wire], "all_gather")
            return tf.bitcast(gathered, dtype) if wire.dtype != dtype else gathered

    def broadcast_send(self, tensor):
        """Sends `tensor` to every other member; returns `tensor`.

        Use the returned tensor: broadcast ops are exempt from the automatic
        control dependencies of `tf.function`, so a send whose result nothing
        uses is pruned and its receivers wait forever. On the NCCL path this
        is an all-reduce to which only the sender contributes (see the class),
        and the returned tensor is its result.
        """
        if self.implementation == "nccl":
            return self.all_reduce(tensor)
        with tf.device(self.device):
            wire, _ = _as_copyable(tensor)
            sent = self._issue(lambda: collective_ops.broadcast_send_v2(
                wire, communication_hint="auto", **self._call_args(ordered=False)
            ), [wire], "broadcast_send")
            with tf.control_dependencies([sent]):
                return tf.identity(tensor)

    def broadcast_recv(self, shape, dtype):
        """Receives what the group's sender passes to `broadcast_send`."""
        dtype = tf.as_dtype(dtype)
        if self.implementation == "nccl":
            with tf.device(self.device):
                return self.all_reduce(tf.zeros(shape, dtype))
        wire_dtype = _COPY_AS.get(dtype, dtype)
        with tf.device(self.device):
            received = self._issue(lambda: collective_ops.broadcast_recv_v2(
                shape, wire_dtype, communication_hint="auto",
                **self._call_args(ordered=False),
            ), [], "broadcast_recv")
            return tf.bitcast(received, dtype) if wire_dtype != dtype else received


def _check_nccl_dtype(dtype):
    if dtype not in NCCL_DTYPES:
        raise ValueError(
            f"NCCL cannot sum {dtype.name} (it sums "
            f"{', '.join(d.name for d in NCCL_DTYPES)}): "
            "cast to float32 first, or use implementation='ring'."
        )


def standalone_group(group_size, device, implementation="ring", group_key=1,
                     timeout_seconds=None, max_subgroup_index=0, watch=None):
    """A `CollectiveGroup` of `group_size` workers outside any strategy.

    For tracing tfscale's collectives into a graph on one process
    (`tf.function(...).get_concrete_function()`) without running them: the
    NCCL path's graph on a machine without GPUs (tests/test_nccl_graph.py).
    Running its collectives needs `group_size` processes with collective ops
    configured, which a `tfscale.Strategy` does. `watch`: see `CollectiveGroup`.
    """
    keys = cross_device_utils.CollectiveKeys(group_key_start=group_key)
    assert keys.get_group_key([device]) == group_key
    launcher = _LoopSafeLauncher(
        group_key, group_size, keys, device,
        tf.distribute.experimental.CommunicationOptions(),
        loop_instance_keys=[])
    return CollectiveGroup(launcher, timeout_seconds, implementation=implementation,
                           max_subgroup_index=max_subgroup_index, watch=watch)


# Broadcast and all-gather only copy bytes, but their kernels list the dtypes
# they accept and bfloat16 is not among them: send its bits as float16.
_COPY_AS = {tf.bfloat16: tf.float16}


def _as_copyable(tensor):
    """`(tensor bitcast to a dtype the copy kernels take, original dtype)`."""
    dtype = tensor.dtype
    if dtype in _COPY_AS:
        return tf.bitcast(tensor, _COPY_AS[dtype]), dtype
    return tensor, dtype


class TfscaleCollectiveAllReduce(_LoopSafeCollectiveAllReduce):
    """MWMS's `CollectiveAllReduce`, with dense all-reduces routed to tfscale.

    Keras 3 reduces gradients, metrics and losses through
    `ReplicaContext.all_reduce` -> `CrossDeviceOps.batch_reduce` ->
    `CollectiveAllReduce._all_reduce`; overriding that last (private) method
    is the narrowest hook that sees all of them. Sparse values (IndexedSlices)
    keep TensorFlow's own path.

    Args:
        all_reduce_fn: `fn(tensors, group) -> tensors` that sums a list of dense
            tensors over `group` (a `CollectiveGroup` of all workers).
        timeout_seconds: collective timeout for tfscale's own collectives.
        key_base: the strategy's collective key base (`take_collective_keys`).
        implementation: `"ring"` or `"nccl"`, see `CollectiveGroup`.
        **stock_args: what MWMS built its own `CollectiveAllReduce` with
            (`_stock_args`), so that the group key stays the same.
    """

    def __init__(self, all_reduce_fn, timeout_seconds, key_base,
                 implementation="ring", watch=None, max_subgroup_index=0,
                 **stock_args):
        super().__init__(**stock_args)
        self._all_reduce_fn = all_reduce_fn
        self.groups = [
            CollectiveGroup(launcher, timeout_seconds, key_base, implementation,
                            watch=watch, max_subgroup_index=max_subgroup_index)
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
        group = self.groups[replica_id]
        reduced = self._all_reduce_fn(flat_values, group)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            reduced = [r / self._group_size for r in reduced]
        return nest.pack_sequence_as(value, reduced)


def _stock_args(strategy):
    """The arguments MWMS built its `CollectiveAllReduce` with: its devices,
    group size, communication options and collective keys."""
    extended = strategy.extended
    return dict(
        devices=extended._cross_device_ops._devices,
        group_size=extended._cross_device_ops._group_size,
        options=extended._communication_options,
        collective_keys=extended._collective_keys,
    )


def install_cross_device_ops(strategy, all_reduce_fn, timeout_seconds,
                             implementation="ring", watch=None,
                             max_subgroup_index=0):
    """Makes `strategy` (an MWMS) reduce through `all_reduce_fn` (see
    `TfscaleCollectiveAllReduce`; `watch`, `max_subgroup_index`: see
    `CollectiveGroup`).

    Returns the installed `TfscaleCollectiveAllReduce`.
    """
    ops = TfscaleCollectiveAllReduce(
        all_reduce_fn, timeout_seconds, strategy._collective_key_base,
        implementation, watch=watch, max_subgroup_index=max_subgroup_index,
        **_stock_args(strategy))
    strategy.extended._cross_device_ops = ops
    return ops


class _WrappedCollectiveAllReduce(_LoopSafeCollectiveAllReduce):
    """MWMS's own `CollectiveAllReduce`, each batch run through `wrap`."""

    def __init__(self, wrap, **stock_args):
        super().__init__(**stock_args)
        self._wrap = wrap

    def _all_reduce(self, reduce_op, value, replica_id, options):
        parent = super()._all_reduce
        return self._wrap(lambda v: parent(reduce_op, v, replica_id, options), value)


def install_stock_cross_device_ops(strategy, wrap=None):
    """Gives a stock MWMS its own all-reduce, loop-safe (same group key).

    Its algorithm is unchanged (TensorFlow's own collectives, packed as its
    `CommunicationOptions` say). `wrap(reduce, value) -> reduce(value)`, if
    given, runs each batch (benchmarks time stock's all-reduces with it as
    tfscale's are timed).
    """
    if wrap is None:
        ops = _LoopSafeCollectiveAllReduce(**_stock_args(strategy))
    else:
        ops = _WrappedCollectiveAllReduce(wrap, **_stock_args(strategy))
    strategy.extended._cross_device_ops = ops


def abort_collectives(message):
    """Fails every pending and later collective op of this process with
    `message` (DEADLINE_EXCEEDED), as MultiWorkerMirroredStrategy's own
    health check does when it loses a peer."""
    context.context().abort_collective_ops(
        tf.errors.DEADLINE_EXCEEDED, message)
