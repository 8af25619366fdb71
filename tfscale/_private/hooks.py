"""Whether every private TensorFlow/Keras hook tfscale relies on is where it
expects it: checked by `tfscale.Strategy()` before anything trains.

`HOOKS` lists each private name the other modules of `tfscale._private` call,
replace, read or recognize, with what was tested of it: the parameter names
of its signature (`inspect.signature`), the attributes and names its code
uses (an instance attribute tfscale reads is checked in the method that sets
it), the functions it defines inside (tfscale recognizes them by qualified
name). A hook tfscale has already replaced (a second Strategy) is checked
through tfscale's replacement, which keeps the tested signature.

Signatures, uses and nested functions were read on TensorFlow 2.20 and 2.21
with each Keras from 3.10 to 3.15 (the same on all of them, but for
`LossScaleOptimizer`'s constructor, which tfscale does not call).
"""

import importlib
import inspect
from typing import NamedTuple

import keras
import tensorflow as tf
from absl import logging

from tfscale._private import keras_hooks


class Hook(NamedTuple):
    """One private TensorFlow/Keras name and what tfscale needs of it.

    Attributes:
        module: the module it lives in (`"keras.src.losses.loss"`).
        name: its dotted path in `module` (`"TFOptimizer._clip_gradients"`).
        parameters: the tested parameter names of the function (or method,
            `self` included) tfscale calls or replaces; None: not checked (a
            class, a constant, a property, a method tfscale does not call).
        uses: attribute names (or string constants) its code uses: the
            instance attributes it sets that tfscale reads, the attributes it
            reads that tfscale writes, a variable name tfscale looks for.
        defines: names of functions defined inside it that tfscale
            recognizes by qualified name.
        same_as: `(module, name)` of the object it must be (or tfscale's
            stand-in for it).
    """

    module: str
    name: str
    parameters: tuple = None
    uses: tuple = ()
    defines: tuple = ()
    same_as: tuple = None

    @property
    def where(self):
        return f"{self.module}.{self.name}"


_TRAINER = "keras.src.trainers.trainer"
_TF_TRAINER = "keras.src.backend.tensorflow.trainer"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer"
_BASE_OPTIMIZER = "keras.src.optimizers.base_optimizer"
_LOSS = "keras.src.losses.loss"
_CALLBACKS = "keras.src.callbacks.callback_list"
_CROSS_DEVICE_OPS = "tensorflow.python.distribute.cross_device_ops"
_CROSS_DEVICE_UTILS = "tensorflow.python.distribute.cross_device_utils"
_MWMS = "tensorflow.python.distribute.collective_all_reduce_strategy"
_CONTEXT = "tensorflow.python.eager.context"
_COLLECTIVE_OPS = "tensorflow.python.ops.collective_ops"
_ACD = "tensorflow.python.framework.auto_control_deps"
_INPUT_LIB = "tensorflow.python.distribute.input_lib"
_INPUT_UTIL = "tensorflow.python.distribute.input_util"

# Each private use, by the module of tfscale._private that makes it (see the
# package's docstring for what each is for and the test that proves it).
HOOKS = (
    # keras_hooks
    Hook(_TRAINER, "LossScaleOptimizer",
         same_as=("keras.optimizers", "LossScaleOptimizer")),
    Hook(_TRAINER, "Trainer.__init__", uses=("_initial_epoch",)),
    Hook(_TF_TRAINER, "TensorFlowTrainer.fit", uses=("_initial_epoch",)),
    Hook(_TF_TRAINER, "TensorFlowTrainer._maybe_symbolic_build",
         ("self", "iterator", "data_batch")),
    Hook(_TF_TRAINER, "TensorFlowTrainer._make_function", ("self", "step_function"),
         defines=("function",)),
    Hook(_TF_TRAINER, "TensorFlowTrainer.make_train_function", ("self", "force")),
    Hook(_TF_TRAINER, "TensorFlowTrainer.make_test_function", ("self", "force")),
    Hook(_TF_TRAINER, "TensorFlowTrainer.make_predict_function", ("self", "force"),
         defines=("one_step_on_data",)),
    Hook(_TF_OPTIMIZER, "TFOptimizer.__init__", uses=("_distribution_strategy",)),
    Hook(_TF_OPTIMIZER, "TFOptimizer._backend_apply_gradients",
         ("self", "grads", "trainable_variables")),
    Hook(_TF_OPTIMIZER, "TFOptimizer._clip_gradients", ("self", "grads")),
    Hook(_TF_OPTIMIZER, "TFOptimizer._apply_weight_decay", ("self", "variables")),
    Hook(_TF_OPTIMIZER, "TFOptimizer._distributed_tf_update_step",
         ("self", "distribution", "grads_and_vars", "learning_rate")),
    Hook(_TF_OPTIMIZER, "TFOptimizer._backend_increment_gradient_accumulators",
         ("self", "grads", "acc_grads")),
    Hook(_TF_OPTIMIZER, "TFOptimizer._backend_reset_gradient_accumulators", ("self",)),
    Hook(_TF_OPTIMIZER, "TFOptimizer._get_variable_index", ("self", "variable")),
    Hook(_TF_OPTIMIZER, "TFOptimizer._update_model_variables_moving_average",
         ("self", "trainable_variables")),
    Hook(_TF_OPTIMIZER, "TFOptimizer._overwrite_model_variables_with_average_value",
         ("self", "trainable_variables")),
    Hook(_BASE_OPTIMIZER, "BaseOptimizer.__init__",
         uses=("_iterations", "_trainable_variables")),
    Hook(_BASE_OPTIMIZER, "BaseOptimizer.build", uses=("_accumulated_gradients",)),
    Hook(_LOSS, "scale_loss_for_distribution", ("value",)),
    Hook(_LOSS, "unscale_loss_for_distribution", ("value",)),
    Hook(_CALLBACKS, "CallbackList.set_model", ("self", "model")),
    Hook(_CALLBACKS, "CallbackList.on_train_end", ("self", "logs")),
    Hook(_CALLBACKS, "CallbackList.on_train_batch_end", ("self", "batch", "logs")),
    # accessors
    Hook("keras.src.layers.layer", "Layer._flatten_layers",
         ("self", "include_self", "recursive")),
    Hook("keras.src.random.seed_generator", "SeedGenerator.__init__",
         uses=("seed_generator_state",)),
    Hook("tensorflow.python.framework.config", "is_op_determinism_enabled", ()),
    Hook("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext",
         ("graph",)),
    Hook(_INPUT_LIB, "DistributedDatasetsFromFunction.__init__",
         uses=("_cardinality", "_enable_get_next_as_optional")),
    # host_input
    Hook(_INPUT_UTIL, "get_distributed_dataset",
         ("dataset", "input_workers", "strategy", "num_replicas_in_sync", "input_context",
          "options", "build", "replica_order")),
    Hook(_INPUT_UTIL, "get_distributed_datasets_from_function",
         ("dataset_fn", "input_workers", "input_contexts", "strategy", "options", "build",
          "replica_order")),
    Hook(_MWMS, "CollectiveAllReduceExtended._input_workers_with_options",
         ("self", "options")),
    Hook(_MWMS, "CollectiveAllReduceExtended._make_input_context", ("self",)),
    Hook(_INPUT_LIB, "_should_use_multi_device_iterator", ("options",),
         uses=("PER_REPLICA", "experimental_fetch_to_device")),
    Hook(_INPUT_LIB, "DistributedIterator.__init__", uses=("_iterators",)),
    Hook(_INPUT_LIB, "_SingleWorkerOwnedDatasetIterator._make_iterator",
         ("self",), uses=("_iterator",)),
    # graph_order
    Hook("tensorflow.python.autograph.core.config", "CONVERSION_RULES"),
    Hook("tensorflow.python.autograph.core.config_lib", "DoNotConvert.__init__",
         ("self", "module_prefix")),
    Hook("tensorflow.python.autograph.impl.conversion", "is_allowlisted",
         uses=("CONVERSION_RULES",)),
    Hook(_ACD, "ASYNC_STATEFUL_OPS"),
    Hook(_ACD, "AutomaticControlDependencies.__enter__",
         uses=("experimental_acd_manager",)),
    Hook(_ACD, "AutomaticControlDependencies.run_independently", ("self", "op")),
    # tf_collectives
    Hook(_CROSS_DEVICE_OPS, "CollectiveAllReduce.__init__",
         ("self", "devices", "group_size", "options", "collective_keys",
          "canonicalize_devices"),
         uses=("_launchers", "_devices", "_group_size")),
    Hook(_CROSS_DEVICE_OPS, "CollectiveAllReduce._all_reduce",
         ("self", "reduce_op", "value", "replica_id", "options")),
    Hook(_CROSS_DEVICE_UTILS, "CollectiveReplicaLauncher.__init__",
         ("self", "group_key", "group_size", "collective_keys", "device", "options"),
         uses=("_group_key", "_group_size", "_collective_keys", "_device", "_options")),
    Hook(_CROSS_DEVICE_UTILS, "CollectiveReplicaLauncher._next_instance_key", ("self",)),
    Hook(_CROSS_DEVICE_UTILS, "CollectiveReplicaLauncher._use_unique_instance_key",
         ("self",)),
    Hook(_CROSS_DEVICE_UTILS, "CollectiveReplicaLauncher._get_ordering_token", ("self",)),
    Hook(_CROSS_DEVICE_UTILS, "CollectiveKeys.__init__", ("self", "group_key_start")),
    Hook(_CROSS_DEVICE_UTILS, "CollectiveKeys.get_group_key", ("self", "devices")),
    Hook(_CROSS_DEVICE_UTILS, "CollectiveKeys.get_instance_key",
         ("self", "group_key", "device")),
    Hook(_MWMS, "CollectiveAllReduceStrategy._collective_key_base"),
    Hook(_MWMS, "CollectiveAllReduceExtended.__init__",
         uses=("_collective_key_base", "_cluster_resolver", "_communication_options",
               "_cross_device_ops")),
    Hook(_MWMS, "CollectiveAllReduceExtended._initialize_multi_worker",
         uses=("_collective_keys", "_cross_device_ops")),
    Hook("tensorflow.python.distribute.multi_worker_util", "normalize_cluster_spec",
         ("cluster_spec",)),
    Hook("tensorflow.python.distribute.multi_worker_util", "coordination_leader",
         ("cluster_spec",)),
    Hook(_CONTEXT, "Context.__init__", uses=("_coordination_service_config",)),
    Hook(_CONTEXT, "Context.coordination_service"),
    Hook(_CONTEXT, "Context.configure_coordination_service",
         ("self", "service_type", "service_leader", "enable_health_check",
          "cluster_register_timeout_in_ms", "heartbeat_timeout_in_ms",
          "shutdown_barrier_timeout_in_ms", "coordinated_jobs",
          "allow_new_incarnation_to_reconnect")),
    Hook(_CONTEXT, "Context.wait_at_barrier", ("self", "barrier_id", "timeout_in_ms")),
    Hook(_CONTEXT, "Context.abort_collective_ops", ("self", "code", "message")),
    Hook("tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2",
         "CoordinatedJob"),
    Hook(_COLLECTIVE_OPS, "all_reduce_v2",
         ("t", "group_size", "group_key", "instance_key", "merge_op", "final_op",
          "communication_hint", "timeout", "ordering_token", "max_subdivs_per_device",
          "name")),
    Hook(_COLLECTIVE_OPS, "all_gather_v2",
         ("t", "group_size", "group_key", "instance_key", "communication_hint",
          "timeout", "ordering_token", "name")),
    Hook(_COLLECTIVE_OPS, "broadcast_send_v2",
         ("t", "group_size", "group_key", "instance_key", "communication_hint",
          "timeout")),
    Hook(_COLLECTIVE_OPS, "broadcast_recv_v2",
         ("shape", "dtype", "group_size", "group_key", "instance_key",
          "communication_hint", "timeout")),
)


def _find(module, name):
    """The object at `name` in `module`: a class's attributes as defined (a
    function, a property), not bound. Raises ImportError, AttributeError."""
    found = importlib.import_module(module)
    for part in name.split("."):
        found = (inspect.getattr_static(found, part) if inspect.isclass(found)
                 else getattr(found, part))
    return found


def _function(found):
    """The plain function behind a method, property or decorator, or None."""
    if isinstance(found, (staticmethod, classmethod)):
        found = found.__func__
    elif isinstance(found, property):
        found = found.fget
    found = inspect.unwrap(found) if callable(found) else found
    return found if inspect.isfunction(found) else None


def _code_names(code):
    """Names and string constants used by `code` and the functions inside it."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, str):
            names.add(constant)
        elif inspect.iscode(constant):
            names |= _code_names(constant)
    return names


def _nested_functions(code):
    """Names of the functions defined (at any depth) inside `code`."""
    names = set()
    for constant in code.co_consts:
        if inspect.iscode(constant):
            names |= {constant.co_name} | _nested_functions(constant)
    return names


def problem(hook):
    """What is wrong with `hook` in the TensorFlow and Keras imported, in a
    few words after its name; None when it is as tested."""
    try:
        found = _find(hook.module, hook.name)
    except (ImportError, AttributeError):
        return f"{hook.where} is gone"
    if hook.same_as is not None:
        expected = _find(*hook.same_as)
        if found is not expected and not isinstance(
                found, keras_hooks.CompileLossScaleOptimizer):
            return f"{hook.where} is no longer {'.'.join(hook.same_as)}"
    if hook.parameters is None and not hook.uses and not hook.defines:
        return None
    function = _function(found)
    if function is None:
        return f"{hook.where} is no longer a function"
    if hook.parameters is not None:
        parameters = tuple(inspect.signature(function).parameters)
        if parameters != hook.parameters:
            return (f"{hook.where} takes ({', '.join(parameters)}), not the tested "
                    f"({', '.join(hook.parameters)})")
    missing = [name for name in hook.uses if name not in _code_names(function.__code__)]
    if missing:
        return f"{hook.where} no longer uses {', '.join(missing)}"
    missing = [name for name in hook.defines
               if name not in _nested_functions(function.__code__)]
    if missing:
        return f"{hook.where} no longer defines {', '.join(missing)}()"
    return None


_warned = set()


def check(is_tested, tested):
    """Refuses to go on when a hook of `HOOKS` moved; warns once when every
    hook fits but the versions were not tested.

    Args:
        is_tested: `fn(tensorflow_version, keras_version) -> bool`, whether
            tfscale was tested with that pair.
        tested: the tested versions in words ("TensorFlow 2.20 to 2.21 and
            Keras 3.13 to 3.15").

    Raises:
        RuntimeError: in one line, naming each TensorFlow/Keras function
            that moved and the tested versions, before anything trains (a
            hook silently not called trains wrongly: a loss scaled by 1/N,
            gradients clipped before the all-reduce).
    """
    found = f"TensorFlow {tf.__version__} and Keras {keras.__version__}"
    problems = [p for p in map(problem, HOOKS) if p is not None]
    if problems:
        raise RuntimeError(
            f"tfscale cannot run on {found}: it relies on private parts of "
            f"them that moved: {'; '.join(problems)}. tfscale is tested with "
            f"{tested}: install those.")
    if not is_tested(tf.__version__, keras.__version__) and found not in _warned:
        _warned.add(found)
        logging.warning(
            "tfscale is tested with %s, not %s; every private TensorFlow/Keras "
            "hook it relies on is in place.", tested, found)
