"""Every private TensorFlow/Keras API that tfscale uses, and nothing else.

TensorFlow exports no hook for replacing how MultiWorkerMirroredStrategy
all-reduces, nor the raw collective ops over sub-groups of its cluster; tfscale
needs both. Those uses are confined to this module so that a TensorFlow or
Keras upgrade has one place to check; tests/test_private_api.py fails if any
other module touches a private attribute. Each use, what it is for, and the
test that fails loudly when it stops working (versions pinned in setup.py):

- `CollectiveAllReduce._all_reduce` (overridden by
  `TfscaleCollectiveAllReduce`) and `strategy.extended._cross_device_ops`:
  route Keras's gradient, loss and metric all-reduces to tfscale.
  tests/test_strategy.py, test_gradients_are_routed_through_tfscale_cross_device_ops.
- `_TimedCollectiveAllReduce`: times stock MWMS's own all-reduces for the
  benchmarks. tests/test_strategy.py, test_stock_strategy_times_its_all_reduces.
- `CollectiveReplicaLauncher._next_instance_key` (overridden by
  `_LoopSafeLauncher`, installed in every `CollectiveAllReduce` tfscale's
  strategies use, as its `_launchers`): collectives that Keras runs in
  its `steps_per_execution` while loop get an instance key fixed when traced,
  because TensorFlow never feeds the call-time key there (see the class).
  tests/test_steps_per_execution.py, test_loop_instance_keys_are_fixed_at_trace_time.
- `CollectiveReplicaLauncher` / `CollectiveKeys` / `collective_ops`: raw
  collectives over sub-groups of the cluster (`CollectiveGroup`).
  tests/test_collectives.py (float64-oracle all-reduces of every algorithm).
  On the NCCL path every group of a worker takes the ordering token of one
  launcher (`_get_ordering_token`), so that `tf.function`'s automatic
  control dependencies chain all its NCCL collectives; `standalone_group`
  builds a group outside a strategy to trace that graph on CPU.
  tests/test_nccl_graph.py, test_nccl_chains_every_collective_of_a_worker_in_one_shared_order.
- `MultiWorkerMirroredStrategy._collective_key_base`: fresh group keys for
  each Strategy built in one process (`take_collective_keys`), and
  `context.wait_at_barrier`, the coordination service's barrier that keeps
  workers from using a new strategy's collectives before every worker has
  re-enabled them (`wait_for_all_workers`). tests/test_collectives.py, where
  each configuration is its own Strategy (it hung without the barrier), and
  tests/test_strategy.py, test_several_strategies_train_in_one_process.
  The same `context.coordination_service` tells `cluster_connected`, so that
  only a process's first strategy waits for its peers (`tfscale.startup`):
  tests/test_startup.py, which needs the wait, and
  test_several_strategies_train_in_one_process, where a second wait would
  find the port held by TensorFlow.
- `extended._cluster_resolver`, `extended._in_multi_worker_mode`: the
  cluster MWMS resolved. tests/test_topology.py, tests/test_strategy.py.
- `Model._flatten_layers` (`flatten_layers`): every nested layer, to find
  BatchNorm statistics. tests/reliability/test_batch_norm_sync.py.
- Keras's `seed_generator_state` variable path (`seed_generator_states`):
  Dropout's random state, which `tf.train.Checkpoint` does not reach through
  the model. tests/reliability/test_resume.py (bitwise-equal resume).
- The name `LossScaleOptimizer` in `keras.src.trainers.trainer`, which
  `Model.compile` wraps its optimizer in under `mixed_float16`
  (`route_compile_loss_scaling`): under a `tfscale.Strategy` compile builds
  `tfscale.optimizers.LossScaleOptimizer`. tests/test_loss_scale.py,
  test_compile_wraps_in_tfscale_loss_scale_under_a_tfscale_strategy (one
  process) and test_keras_guide_mixed_float16_fit_agrees_to_skip (2 workers).
- `TFOptimizer._backend_apply_gradients` (replaced by
  `route_optimizer_updates`; it calls Keras's `_clip_gradients`,
  `_apply_weight_decay`, `_distributed_tf_update_step`,
  `_backend_increment_gradient_accumulators`,
  `_backend_reset_gradient_accumulators`, `_accumulated_gradients`,
  `_get_variable_index`, `_iterations`): under a `tfscale.Strategy` every Keras
  optimizer all-reduces its gradients first, then clips and decays the
  all-reduced gradient, and accumulates local gradients with one all-reduce
  per accumulated step (`gradient_accumulation_steps`); with
  `compression="powersgd"` the strategy's `powersgd` sums the gradients
  there (tests/test_powersgd.py).
  tests/test_accumulation.py, test_hook_is_installed_on_keras_optimizers
  (one process) and its 2-worker tests. `_iterations` also gives
  `batches_taken`, the data position checkpoints record:
  test_tfscale_train_accumulation_steps.
- `Model._initial_epoch` (`set_initial_epoch`): the epoch a `fit` already
  under way starts from, as Keras's own BackupAndRestore sets it.
  tests/test_backup_and_restore.py, test_resumes_at_the_saved_step.
- `fit` calling `keras.callbacks.CallbackList.set_model` before training
  and `on_train_end` after it (`add_fit_hooks`): where tfscale sees the
  user's callbacks, which `fit` gets and the strategy does not.
  tests/test_keras_callbacks.py, test_fit_calls_the_hooks.
- `keras.src.losses.loss.scale_loss_for_distribution` and
  `unscale_loss_for_distribution` (`route_loss_scaling`): Keras's
  `1 / num_workers` loss scaling, which Keras's losses, its train and test
  steps and its loss metrics look up in that module, becomes each worker's
  share of the step's examples under a `tfscale.Strategy`
  (`tfscale.uneven_data`).
  tests/test_uneven_data.py, test_keras_looks_up_the_routed_loss_scaling.
- Keras's step functions (`keras_step`): `fit` and `evaluate` pass the
  model's bound `train_step` / `test_step` to `strategy.run`, `predict` its
  local `one_step_on_data`; their batches are padded where empty
  (`tfscale.uneven_data`).
  tests/test_uneven_data.py (3 workers, a worker without examples in
  fit, evaluate and predict).
- `DistributedDatasetsFromFunction._cardinality` and
  `_enable_get_next_as_optional` (`set_cardinality`): the batches of each
  worker's own pipeline, which Keras runs as many steps of, agreed among the
  workers (`tfscale.uneven_data.agreed_cardinality`).
  tests/test_uneven_data.py, the `ran_out` scenario (workers whose pipelines
  hold 2, 3 and 4 batches).
- `TensorFlowTrainer._maybe_symbolic_build` (`route_symbolic_build`): Keras
  builds the model from the first batch MEAN-reduced over the workers, which
  fails when their batches differ in size (a global batch 3 workers cannot
  share); it is built from this worker's batch instead.
  tests/test_uneven_data.py, test_symbolic_build_is_routed.
- `context.context().abort_collective_ops` (`abort_collectives`): the
  collective timeout of tfscale's collectives, kept by one watchdog thread
  per worker instead of TensorFlow's thread per timed op
  (`tfscale.collectives.watchdog`). tests/test_watchdog.py,
  test_a_stalled_worker_fails_the_others_after_the_timeout.
- `control_flow_util.GraphOrParentsInXlaContext` (`in_xla_context`): whether
  the function being traced is compiled by XLA (`jit_compile=True`), as MWMS
  asks it to choose between merge_call and not; XLA has no kernel for
  `tf.timestamp`, so compiled steps go untimed.
  tests/test_jit_compile.py, test_in_xla_context_sees_jit_compile.
"""

import itertools

import keras
import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import cross_device_ops as tf_cross_device_ops
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.util import nest
from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss
from keras.src.trainers import trainer as keras_trainer

from tfscale import collectives

# Versions whose private APIs this module was written and tested against.
TESTED_VERSIONS = {"tensorflow": "2.21.", "keras": "3.15."}

# MWMS takes group keys 1, 2, ... for itself (one per device set it reduces
# over); tfscale's own sub-groups start well above them.
_SUBGROUP_KEY_BASE = 1000
# Each Strategy of a process takes this many group keys: MWMS's and its
# sub-groups' (halving-doubling needs n/2 log2(n) pairs). TensorFlow caches
# each (group key, instance key) with its shapes, so a second Strategy reusing
# the first one's keys fails with "Shape mismatch in the collective instance".
# Group keys are int32: 21,474 strategies per process.
_KEYS_PER_STRATEGY = _SUBGROUP_KEY_BASE + collectives.topology.MAX_SUBGROUP_INDEX + 1
_strategies_built = itertools.count()


def take_collective_keys(strategy):
    """Gives `strategy` group keys that no earlier Strategy of this process used.

    Call it before `MultiWorkerMirroredStrategy.__init__`, which reads the
    base. Every worker builds its strategies in the same order, so the keys
    agree across workers.

    Returns:
        The strategy's number in this process (0 for the first).
    """
    number = next(_strategies_built)
    strategy._collective_key_base = number * _KEYS_PER_STRATEGY
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
    worker's port, and its peers have all connected."""
    return context.context().coordination_service is not None


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
        watch: `fn(issue, inputs) -> issue()` that runs each collective op
            (`tfscale.collectives.watchdog.Watchdog`, which keeps the timeout
            without a thread per op; then give `timeout_seconds=None`);
            sub-groups take their parent's. `None`: ops run as they are.
    """

    def __init__(self, launcher, timeout_seconds, key_base=0,
                 implementation="ring", ordering=None, watch=None):
        if implementation not in ("ring", "nccl"):
            raise ValueError(
                "Argument `implementation` must be 'ring' or 'nccl' (resolved "
                f"on the worker's device). Received: implementation={implementation!r}"
            )
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
            index: an integer >= 1, numbering the cluster's sub-groups (see
                `tfscale.collectives.topology.subgroup_indices`).
            size: number of workers in the sub-group.

        Returns:
            A `CollectiveGroup` whose group key is the strategy's key base
            plus `_SUBGROUP_KEY_BASE + index`.
        """
        if not 1 <= index <= collectives.topology.MAX_SUBGROUP_INDEX:
            raise ValueError(
                "Argument `index` must be in 1.."
                f"{collectives.topology.MAX_SUBGROUP_INDEX}. Received: index={index!r}"
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
            watch=self._watch)
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
            ), [tensor])

    def _issue(self, op, inputs):
        """`op()`, through `watch` if given."""
        return op() if self._watch is None else self._watch(op, inputs)

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
            ), [wire])
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
            ), [wire])
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
            ), [])
            return tf.bitcast(received, dtype) if wire_dtype != dtype else received


def _check_nccl_dtype(dtype):
    if dtype not in collectives.implementation.NCCL_DTYPES:
        raise ValueError(
            f"NCCL cannot sum {dtype.name} (it sums "
            f"{', '.join(d.name for d in collectives.implementation.NCCL_DTYPES)}): "
            "cast to float32 first, or use implementation='ring'."
        )


def standalone_group(group_size, device, implementation="ring", group_key=1,
                     timeout_seconds=None):
    """A `CollectiveGroup` of `group_size` workers outside any strategy.

    For tracing tfscale's collectives into a graph on one process
    (`tf.function(...).get_concrete_function()`) without running them: the
    NCCL path's graph on a machine without GPUs (tests/test_nccl_graph.py).
    Running its collectives needs `group_size` processes with collective ops
    configured, which a `tfscale.Strategy` does.
    """
    keys = cross_device_utils.CollectiveKeys(group_key_start=group_key)
    assert keys.get_group_key([device]) == group_key
    launcher = _LoopSafeLauncher(
        group_key, group_size, keys, device,
        tf.distribute.experimental.CommunicationOptions(),
        loop_instance_keys=[])
    return CollectiveGroup(launcher, timeout_seconds, implementation=implementation)


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
                 implementation="ring", watch=None, **stock_args):
        super().__init__(**stock_args)
        self._all_reduce_fn = all_reduce_fn
        self.groups = [
            CollectiveGroup(launcher, timeout_seconds, key_base, implementation,
                            watch=watch)
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
                             implementation="ring", watch=None):
    """Makes `strategy` (an MWMS) reduce through `all_reduce_fn` (see
    `TfscaleCollectiveAllReduce`; `watch`: see `CollectiveGroup`).

    Returns the installed `TfscaleCollectiveAllReduce`.
    """
    ops = TfscaleCollectiveAllReduce(
        all_reduce_fn, timeout_seconds, strategy._collective_key_base,
        implementation, watch=watch, **_stock_args(strategy))
    strategy.extended._cross_device_ops = ops
    return ops


class _TimedCollectiveAllReduce(_LoopSafeCollectiveAllReduce):
    """MWMS's own `CollectiveAllReduce`, each batch timed as tfscale's are."""

    def __init__(self, exposed_communication_seconds, **stock_args):
        super().__init__(**stock_args)
        self._exposed_communication_seconds = exposed_communication_seconds

    def _all_reduce(self, reduce_op, value, replica_id, options):
        parent = super()._all_reduce
        return collectives.timed_all_reduce(
            lambda v: parent(reduce_op, v, replica_id, options),
            value, self._exposed_communication_seconds,
        )


def install_stock_cross_device_ops(strategy, exposed_communication_seconds=None):
    """Gives a stock MWMS its own all-reduce, loop-safe (same group key).

    Its algorithm is unchanged (TensorFlow's own collectives, packed as its
    `CommunicationOptions` say). Given a float64 variable, each all-reduce
    adds its exposed time to it with the timestamps of
    `tfscale.collectives.timed_all_reduce`, so benchmarks measure stock and
    tfscale alike.
    """
    if exposed_communication_seconds is None:
        ops = _LoopSafeCollectiveAllReduce(**_stock_args(strategy))
    else:
        ops = _TimedCollectiveAllReduce(
            exposed_communication_seconds, **_stock_args(strategy))
    strategy.extended._cross_device_ops = ops


def in_xla_context():
    """Whether the graph being built is compiled by XLA (a `tf.function`
    with `jit_compile=True`, or one it calls)."""
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def cluster_spec_dict(strategy):
    """The cluster spec MWMS resolved, as {job: [address, ...]}; {} alone."""
    return strategy.extended._cluster_resolver.cluster_spec().as_dict()


def local_devices(strategy):
    """The devices this worker's replicas run on."""
    return list(strategy.extended.worker_devices)


def in_multi_worker_mode(strategy):
    return strategy.extended._in_multi_worker_mode()


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


class CompileLossScaleOptimizer:
    """Stands in for `LossScaleOptimizer` where `Model.compile` looks it up.

    Keras 3.15's `Trainer.compile` (keras/src/trainers/trainer.py) does, with
    the name `LossScaleOptimizer` its module imported:

    ```python
    if (auto_scale_loss and self.dtype_policy.name == "mixed_float16"
            and self.optimizer
            and not isinstance(self.optimizer, LossScaleOptimizer)):
        self.optimizer = LossScaleOptimizer(
            self.optimizer, name="loss_scale_optimizer")
    ```

    Keras exposes no way to choose that class. This object takes the name's
    place: `isinstance` answers as Keras's class does (an optimizer that
    already is a Keras `LossScaleOptimizer`, tfscale's included, is not
    wrapped), and calling it builds the class `choose()` returns at that
    moment.

    Args:
        keras_class: Keras's `LossScaleOptimizer`, the class replaced.
        choose: `fn() -> class`, a subclass of `keras_class` (or it) to build.
    """

    def __init__(self, keras_class, choose):
        self.keras_class = keras_class
        self.choose = choose

    def __instancecheck__(self, instance):
        return isinstance(instance, self.keras_class)

    def __call__(self, *args, **kwargs):
        cls = self.choose()
        if not issubclass(cls, self.keras_class):
            raise TypeError(
                f"Argument `choose` must return a subclass of {self.keras_class}. "
                f"Received: choose() returned {cls!r}")
        return cls(*args, **kwargs)


def route_compile_loss_scaling(choose):
    """Makes `Model.compile` build its automatic loss-scale wrapper with
    `choose()`, the class to use (see `CompileLossScaleOptimizer`).

    Idempotent: a second call only replaces `choose`.

    Returns:
        The installed `CompileLossScaleOptimizer`.

    Raises:
        RuntimeError: under the `mixed_float16` policy, when
            `keras.src.trainers.trainer.LossScaleOptimizer` is no longer
            Keras's class (a Keras change moved it), rather than letting
            compile silently wrap in a loss scaling that deadlocks. Under
            other policies the same is a warning, and None is returned.
    """
    current = getattr(keras_trainer, "LossScaleOptimizer", None)
    if type(current) is CompileLossScaleOptimizer:
        current.choose = choose
        return current
    if current is not keras.optimizers.LossScaleOptimizer:
        message = (
            "tfscale cannot make Model.compile wrap its optimizer in "
            "tfscale.optimizers.LossScaleOptimizer under mixed_float16: Keras "
            f"{keras.__version__} no longer has `LossScaleOptimizer` in "
            "keras.src.trainers.trainer (tested with Keras "
            f"{TESTED_VERSIONS['keras']}x), and Keras's own one deadlocks "
            "when one worker overflows. Install the pinned Keras, or pass "
            "optimizer=tfscale.optimizers.LossScaleOptimizer(your_optimizer) "
            f"to compile yourself. Found: {current!r}")
        if keras.mixed_precision.global_policy().name == "mixed_float16":
            raise RuntimeError(message)
        logging.warning(message)
        return None
    hook = CompileLossScaleOptimizer(current, choose)
    keras_trainer.LossScaleOptimizer = hook
    return hook


def set_initial_epoch(model, epoch):
    """Makes the `fit` under way start at `epoch` (`None`: its argument).

    Call it from a callback's `on_train_begin`: Keras's fit reads the value
    right after (keras.src.backend.tensorflow.trainer, `fit`), and keeps it
    for later fits until it is reset to `None`.
    """
    model._initial_epoch = epoch


_fit_hooks = []


def add_fit_hooks(on_set_model, on_train_end):
    """Calls `on_set_model(callback_list, model)` before a `fit` (or
    `evaluate`, `predict`) hands its model to the callbacks, and
    `on_train_end(callback_list)` after every callback's `on_train_end`.

    Wraps `keras.callbacks.CallbackList`'s `set_model` and `on_train_end`
    once per process. `set_model` is where `fit` first shows the callbacks
    (`callback_list.callbacks`) their model, before any of them has written
    anything (TensorBoard writes the model's summary there). A hook pair
    added twice runs once.

    Returns:
        A function that removes the pair again.
    """
    pair = (on_set_model, on_train_end)

    def remove():
        if pair in _fit_hooks:
            _fit_hooks.remove(pair)

    if pair in _fit_hooks:
        return remove
    _fit_hooks.append(pair)
    callback_list = keras.callbacks.CallbackList
    if getattr(callback_list.set_model, "tfscale_hooked", False):
        return remove
    original_set_model = callback_list.set_model
    original_end = callback_list.on_train_end

    def set_model(self, model):
        if model:
            for begin, _ in _fit_hooks:
                begin(self, model)
        return original_set_model(self, model)

    def on_train_end(self, logs=None):
        try:
            return original_end(self, logs)
        finally:
            for _, end in _fit_hooks:
                end(self)

    set_model.tfscale_hooked = True
    callback_list.set_model = set_model
    callback_list.on_train_end = on_train_end
    return remove


def route_optimizer_updates(applies):
    """Makes Keras optimizers all-reduce first where `applies(strategy)`.

    Keras 3.15's `BaseOptimizer._backend_apply_gradients` clips and decays
    each worker's LOCAL gradient and only then all-reduces it (inside
    `TFOptimizer._backend_update_step`): `clipnorm`, `global_clipnorm` and
    `clipvalue` mean something else on N workers than on one. With
    `gradient_accumulation_steps` it branches with `ops.cond` in the replica
    context around that all-reduce, whose `merge_call` then fails ("merge_call
    called while defining a new graph or a tf.function"), and it would
    all-reduce every micro-batch. Replaced, for the optimizers whose strategy
    `applies` accepts, by `_apply_all_reduced_first`; other optimizers keep
    Keras's method. Idempotent: a second call only replaces `applies`.
    """
    cls = keras_tf_optimizer.TFOptimizer
    current = cls.__dict__.get("_backend_apply_gradients")
    if current is not None and getattr(current, "tfscale_applies", None) is not None:
        current.tfscale_applies[0] = applies
        return
    keras_method = cls._backend_apply_gradients
    chosen = [applies]

    def _backend_apply_gradients(self, grads, trainable_variables):
        if chosen[0](tf.distribute.get_strategy()):
            return _apply_all_reduced_first(self, grads, trainable_variables)
        return keras_method(self, grads, trainable_variables)

    _backend_apply_gradients.tfscale_applies = chosen
    cls._backend_apply_gradients = _backend_apply_gradients


def batches_taken(optimizer):
    """Batches `optimizer` has been applied to: Keras's `_iterations`.

    Keras's public `iterations` counts updates; with
    `gradient_accumulation_steps=k` that is the micro-batches taken // k,
    which loses the data position mid-step. A `LossScaleOptimizer` counts
    its inner optimizer's (skipped steps are not taken).
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return batches_taken(inner)
    return int(optimizer._iterations.numpy())


def optimizer_updates_routed(optimizer):
    """Whether `optimizer`'s class takes `route_optimizer_updates`' method."""
    method = type(optimizer)._backend_apply_gradients
    return getattr(method, "tfscale_applies", None) is not None


def _apply_all_reduced_first(optimizer, grads, trainable_variables):
    """Keras's `_backend_apply_gradients`, reordered for many workers.

    Without accumulation: all-reduce (sum) the gradients, clip them, apply
    weight decay and the update; the update itself does not all-reduce again.

    With `gradient_accumulation_steps=k`: the first k-1 micro-batches only add
    their LOCAL gradient to the accumulators (no communication); the k-th
    all-reduces the accumulated sum plus its own gradient once, divides by k
    (Keras's mean over the micro-batches), clips, decays, updates and zeroes
    the accumulators. Every worker counts the same iterations, so all take
    the same branch. The branch is chosen in cross-replica context, as
    Keras's `LossScaleOptimizer` does, because `merge_call` (which the
    all-reduce and the variable updates use) cannot run inside a `cond` of a
    replica context.

    EMA (`use_ema`) runs after it as in Keras.
    """
    strategy = optimizer._distribution_strategy
    steps = optimizer.gradient_accumulation_steps

    def update(grads, scale=None):
        # Replica context: every replica at once, never inside a replica cond.
        powersgd = getattr(strategy, "powersgd", None)
        if powersgd is not None:  # tfscale.Strategy(compression="powersgd")
            reduced = powersgd.all_reduce(
                list(grads), optimizer, trainable_variables, optimizer.iterations)
        else:
            reduced = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, list(grads))
        if scale is not None:
            reduced = [g / scale for g in reduced]
        reduced = optimizer._clip_gradients(reduced)
        optimizer._apply_weight_decay(trainable_variables)
        variables = [v.value if isinstance(v, keras.Variable) else v
                     for v in trainable_variables]
        tf.__internal__.distribute.interim.maybe_merge_call(
            optimizer._distributed_tf_update_step, strategy,
            list(zip(reduced, variables)), optimizer.learning_rate)

    if not steps:
        update(grads)
    else:
        accumulators = [
            optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
            for v in trainable_variables]
        grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices: dense

        def apply_accumulated(grads):
            update([g + a.value for g, a in zip(grads, accumulators)],
                   scale=steps)
            optimizer._backend_reset_gradient_accumulators()

        def accumulate(grads):
            optimizer._backend_increment_gradient_accumulators(grads, accumulators)

        def is_update_step():
            return (optimizer._iterations + 1) % steps == 0

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            keras.ops.cond(is_update_step(), lambda: apply_accumulated(grads),
                           lambda: accumulate(grads))
        else:
            def branch_in_cross_replica(distribution, grads):
                call = distribution.extended.call_for_each_replica
                keras.ops.cond(is_update_step(),
                               lambda: call(apply_accumulated, args=(grads,)),
                               lambda: call(accumulate, args=(grads,)))

            tf.distribute.get_replica_context().merge_call(
                branch_in_cross_replica, args=(grads,))

    if optimizer.use_ema:
        optimizer._update_model_variables_moving_average(
            optimizer._trainable_variables)
        if optimizer.ema_overwrite_frequency:
            keras.ops.cond(
                (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0,
                lambda: optimizer._overwrite_model_variables_with_average_value(
                    optimizer._trainable_variables),
                lambda: None)


def route_loss_scaling(scale, unscale):
    """Makes Keras scale each worker's loss with `scale(value, keras_scale)`
    and unscale it with `unscale(value, keras_unscale)`, where `keras_scale`
    and `keras_unscale` are Keras's own `scale_loss_for_distribution` and
    `unscale_loss_for_distribution` (`value / num_workers`, `value *
    num_workers`).

    Keras's losses (`reduce_values`), `Trainer._aggregate_additional_loss`,
    the TensorFlow trainer's steps and its loss metrics all look the two
    functions up in `keras.src.losses.loss` when called. Idempotent: a second
    call only replaces `scale` and `unscale`.
    """
    current = keras_loss.scale_loss_for_distribution
    routes = getattr(current, "tfscale_routes", None)
    if routes is None:
        keras_scale = current
        keras_unscale = keras_loss.unscale_loss_for_distribution
        routes = {}

        def scale_loss_for_distribution(value):
            return routes["scale"](value, keras_scale)

        def unscale_loss_for_distribution(value):
            return routes["unscale"](value, keras_unscale)

        scale_loss_for_distribution.tfscale_routes = routes
        keras_loss.scale_loss_for_distribution = scale_loss_for_distribution
        keras_loss.unscale_loss_for_distribution = unscale_loss_for_distribution
    routes.update(scale=scale, unscale=unscale)


def loss_scaling_routed():
    """Whether `route_loss_scaling` is in place."""
    return getattr(keras_loss.scale_loss_for_distribution, "tfscale_routes", None) is not None


def route_symbolic_build(applies):
    """Makes Keras build a model under a strategy `applies(strategy)` accepts
    from this worker's first batch alone.

    Keras 3.15's `TensorFlowTrainer._maybe_symbolic_build` takes the first
    batch of `fit`, `evaluate` or `predict` and MEAN-reduces it element-wise
    over the workers only to learn its shapes; when the workers' batches
    differ in size (32 examples on 3 workers: 11, 11, 10) that all-reduce
    fails with "Shape mismatch in the collective instance". The local batch
    has the same shapes but the batch size, which building ignores, and
    needs no collective. Idempotent: a second call only replaces `applies`.
    """
    cls = keras_tf_trainer.TensorFlowTrainer
    current = cls.__dict__["_maybe_symbolic_build"]
    chosen = getattr(current, "tfscale_applies", None)
    if chosen is not None:
        chosen[0] = applies
        return
    keras_method = current
    chosen = [applies]

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or strategy is None or not chosen[0](strategy):
            return keras_method(self, iterator=iterator, data_batch=data_batch)
        for _, _, batches in iterator:
            data_batch = tf.nest.map_structure(
                lambda v: (strategy.experimental_local_results(v)[0]
                           if isinstance(v, tf.distribute.DistributedValues) else v),
                next(batches))
            break
        return keras_method(self, iterator=None, data_batch=data_batch)

    _maybe_symbolic_build.tfscale_applies = chosen
    cls._maybe_symbolic_build = _maybe_symbolic_build


def symbolic_build_routed():
    """Whether `route_symbolic_build` is in place."""
    method = keras_tf_trainer.TensorFlowTrainer.__dict__["_maybe_symbolic_build"]
    return getattr(method, "tfscale_applies", None) is not None


# `predict`'s replica function in Keras 3.15 (keras/src/backend/tensorflow/
# trainer.py, `make_predict_function`), which calls `model.predict_step`.
_KERAS_PREDICT_STEP = "TensorFlowTrainer.make_predict_function.<locals>.one_step_on_data"


def keras_step(fn):
    """`"train"`, `"test"` or `"predict"` when `fn`, given to
    `strategy.run`, is that step of a Keras model's `fit`, `evaluate` or
    `predict`; None otherwise."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, keras_trainer.Trainer):
        return {"train_step": "train", "test_step": "test"}.get(fn.__name__)
    if getattr(fn, "__qualname__", None) == _KERAS_PREDICT_STEP:
        return "predict"
    return None



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


def abort_collectives(message):
    """Fails every pending and later collective op of this process with
    `message` (DEADLINE_EXCEEDED), as MultiWorkerMirroredStrategy's own
    health check does when it loses a peer."""
    context.context().abort_collective_ops(
        tf.errors.DEADLINE_EXCEEDED, message)
