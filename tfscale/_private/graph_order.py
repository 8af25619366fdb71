"""How `tf.function` traces tfscale: its code as written, not converted by
autograph (a private TensorFlow list of rules), and where its bookkeeping ops
go: `tf.timestamp` (a private TensorFlow list) and ops marked to run
independently (a private method of the graph's automatic control
dependencies); see `tfscale._private`."""

from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.framework import ops

_TIMESTAMP = "Timestamp"


def trace_unconverted(package):
    """Has autograph call `package`'s functions as written, as it calls
    TensorFlow's and Keras's (`DoNotConvert` in its `CONVERSION_RULES`,
    beside those of `tensorflow`, `keras` and `tensorflow_probability`).

    tfscale builds its graphs in Python, looping over buckets and groups
    known when traced. A user's `tf.function` that calls it (a custom
    loop's `strategy.reduce`, an algorithm of `tfscale.collectives`) would
    otherwise have autograph convert each such function again at every
    trace: a third of the CPU of tracing the all-reduces of every
    algorithm on 4 workers (tests/workers/collectives_all_reduce.py, 66
    against 46 CPU-seconds). The user's own functions are converted as
    before.
    """
    rule = autograph_config.DoNotConvert(package)
    if not any(str(r) == str(rule) for r in autograph_config.CONVERSION_RULES):
        autograph_config.CONVERSION_RULES = (
            (rule,) + tuple(autograph_config.CONVERSION_RULES))


def unorder_timestamps():
    """Lets each `tf.timestamp` run where its control inputs put it.

    `tf.function` runs the stateful ops that touch no resource in program
    order (`AutomaticControlDependencies`, "stateful ops are in program
    order"), and `Timestamp` is one: a stamp taken after bucket 0's result
    would hold back every stamp, and so every collective whose flight-record
    row holds one, traced after it, and the buckets would no longer overlap
    backprop or each other. Listed with the asynchronous collectives
    (`ASYNC_STATEFUL_OPS`), a stamp depends on what its control inputs say,
    and still runs where a variable write consumes it. For the whole
    process: a user's own `tf.timestamp` in a `tf.function` is no longer
    ordered after the stateful ops traced before it.
    """
    if not isinstance(getattr(auto_control_deps, "ASYNC_STATEFUL_OPS", None), frozenset):
        raise RuntimeError(
            "tensorflow.python.framework.auto_control_deps.ASYNC_STATEFUL_OPS is "
            "gone: this TensorFlow is not a tested one (tfscale/_version.py); "
            "the timeline cannot place its stamps.")
    if _TIMESTAMP not in auto_control_deps.ASYNC_STATEFUL_OPS:
        auto_control_deps.ASYNC_STATEFUL_OPS = (
            auto_control_deps.ASYNC_STATEFUL_OPS | {_TIMESTAMP})


def unordered(value):
    """`value`, whose op `tf.function` runs once its inputs are ready rather
    than in program order among the ops on the same resource or the other
    stateful ops (`AutomaticControlDependencies.run_independently`); it
    still runs before the function returns. Outside `tf.function`: `value`.

    For bookkeeping no later op depends on: a counter's fetch-and-add, a
    flight-record row, a timestamp.
    """
    op = getattr(value, "op", value)
    manager = getattr(ops.get_default_graph(), "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(op)
    return value


def unordered_case(output):
    """Lets the `Case` (or `If`) op computing `output` run once its inputs
    are ready (`unordered`); its outputs may come through `Identity`.
    Eager: nothing to do."""
    op = getattr(output, "op", None)  # None when eager
    if op is None:
        return
    while op.type == "Identity":
        op = op.inputs[0].op
    unordered(op)
