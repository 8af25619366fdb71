"""What tests/test_worker_pool.py runs in reused workers, and
tests/test_garbage_collection.py in fresh ones.

Usage: pool_probe.py MODE [--probe=VALUE]
- `state`: reports what a script sees of the process: pid, Keras's dtype
  policy and floatx, POOL_PROBE in the environment, the working directory,
  --probe, absl's verbosity.
- `dirty`: changes all of those, then reports them.
- `fail`: worker 1 raises; the others wait for it in an all-reduce.
- `determinism`: turns op determinism on.
- `process`: reports how the process started: argv[0], sys.path[0], the
  garbage collector's state, and what became of what `leave` left.
- `leave`: leaves garbage (a reference cycle in the oldest generation) and
  a survivor (an object kept on `sys`, which outlives the scenario), and
  switches the collector off.
"""

import gc
import os
import sys
import weakref

import keras
import tensorflow as tf
from absl import app
from absl import flags
from absl import logging

import tfscale
from report import report
from report import worker_index

flags.DEFINE_string("probe", "default", "A flag of this script.")
FLAGS = flags.FLAGS


def state():
    return {"pid": os.getpid(), "policy": keras.mixed_precision.global_policy().name,
            "floatx": keras.config.floatx(), "env": os.environ.get("POOL_PROBE"),
            "cwd": os.getcwd(), "probe": FLAGS.probe, "verbosity": logging.get_verbosity()}


class _Referable:
    """A weakly referable object, tracked by the collector, in `holder`."""

    def __init__(self, holder):
        holder["watched"] = self
        self.holder = holder


def main(argv):
    mode = argv[1]
    if mode == "dirty":
        keras.config.set_floatx("float64")
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        os.environ["POOL_PROBE"] = "dirty"
        os.chdir("/")
        logging.set_verbosity(logging.ERROR)
    elif mode == "fail":
        strategy = tfscale.Strategy()
        if worker_index() == 1:
            raise RuntimeError("pool probe: worker 1 fails on purpose")
        strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    elif mode == "determinism":
        tf.config.experimental.enable_op_determinism()
    elif mode == "process":
        garbage = getattr(sys, "pool_probe_garbage", None)
        survivor = getattr(sys, "pool_probe_survivor", None)
        report({"argv0": sys.argv[0], "path0": sys.path[0], "collecting": gc.isenabled(),
                "frozen": gc.get_freeze_count(),
                "garbage_alive": None if garbage is None else garbage() is not None,
                # gc.get_objects() lists every tracked object but the frozen.
                "survivor_frozen": None if survivor is None else
                not any(o is survivor for o in gc.get_objects())})
        return
    elif mode == "leave":
        cycle = {}
        cycle["self"] = cycle  # freed only by a collection
        sys.pool_probe_garbage = weakref.ref(_Referable(cycle))
        sys.pool_probe_survivor = _Referable({})
        gc.collect()  # both survive into the oldest generation...
        del cycle  # ...where only a full collection finds the garbage
        gc.disable()  # and none runs before the pool's
        report({"left": ["garbage", "survivor"]})
        return
    report(state())


if __name__ == "__main__":
    app.run(main)
