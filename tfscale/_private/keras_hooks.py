"""Keras's own methods, routed where Keras has no public hook (private APIs;
see `tfscale._private`)."""

import keras
import tensorflow as tf
from absl import logging
from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss
from keras.src.trainers import trainer as keras_trainer


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
            "keras.src.trainers.trainer (tfscale.Strategy() names the tested "
            "Keras versions), and Keras's own one deadlocks "
            "when one worker overflows. Install a tested Keras, or pass "
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


_batch_end_hooks = []


def add_train_batch_end_hook(hook):
    """Calls `hook(model)` after each batch of each `fit`, in the training
    loop's own thread once the callbacks' `on_train_batch_end` are called or
    handed to Keras's thread pool (`CallbackList._async_train`): before
    the next batch on every worker alike. Wraps
    `keras.callbacks.CallbackList.on_train_batch_end` once per process; a
    hook added twice runs once."""
    if hook not in _batch_end_hooks:
        _batch_end_hooks.append(hook)
    callback_list = keras.callbacks.CallbackList
    if getattr(callback_list.on_train_batch_end, "tfscale_hooked", False):
        return
    original = callback_list.on_train_batch_end

    def on_train_batch_end(self, batch, logs=None):
        original(self, batch, logs)
        for hook in _batch_end_hooks:
            hook(self.model)

    on_train_batch_end.tfscale_hooked = True
    callback_list.on_train_batch_end = on_train_batch_end


# What Keras 3.15's TensorFlow trainer returns as a train or test function
# (keras.src.backend.tensorflow.trainer, `_make_function`).
_KERAS_FUNCTION = "TensorFlowTrainer._make_function.<locals>.function"


def _is_keras_function(function):
    return getattr(function, "__qualname__", None) == _KERAS_FUNCTION


def _train_function_wrapper(model):
    """The tfscale callback whose wrapper is `model.train_function` (it
    holds Keras's in `wrapped_train_function`, as
    `tfscale.callbacks.BackupAndRestore` does), or None."""
    wrapper = getattr(model.train_function, "__self__", None)
    return wrapper if hasattr(wrapper, "wrapped_train_function") else None


def can_retrace_train_function(model):
    """Whether `retrace_train_function` would lose no wrapper: the train
    function is Keras's own or a tfscale wrapper of Keras's own, and the
    test function Keras's own or not built yet."""
    wrapper = _train_function_wrapper(model)
    train = model.train_function if wrapper is None else wrapper.wrapped_train_function
    return _is_keras_function(train) and (
        model.test_function is None or _is_keras_function(model.test_function))


def retrace_train_function(model):
    """Makes Keras build `model`'s train (and test) function anew: its next
    call traces it again. Under a tfscale wrapper (`_train_function_wrapper`)
    the new train function goes under the wrapper. Check
    `can_retrace_train_function` first: any other wrapper would be lost."""
    current, wrapper = model.train_function, _train_function_wrapper(model)
    model.make_train_function(force=True)
    if wrapper is not None:
        wrapper.wrapped_train_function = model.train_function
        model.train_function = current
    if model.test_function is not None:
        model.make_test_function(force=True)


def route_optimizer_updates(reducer_for):
    """Makes Keras optimizers all-reduce first where `reducer_for(strategy)`
    gives a reducer: `reduce(grads, optimizer, trainable_variables) -> summed
    grads`, run in replica context (None: Keras's own method).

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
        current.tfscale_applies[0] = reducer_for
        return
    keras_method = cls._backend_apply_gradients
    chosen = [reducer_for]

    def _backend_apply_gradients(self, grads, trainable_variables):
        reduce = chosen[0](tf.distribute.get_strategy())
        if reduce is not None:
            return _apply_all_reduced_first(self, grads, trainable_variables, reduce)
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


def _apply_all_reduced_first(optimizer, grads, trainable_variables, reduce):
    """Keras's `_backend_apply_gradients`, reordered for many workers.

    Without accumulation: all-reduce (sum, with `reduce(grads, optimizer,
    trainable_variables)`) the gradients, clip them, apply
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
        reduced = reduce(list(grads), optimizer, trainable_variables)
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
