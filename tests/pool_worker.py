"""One worker of a reused test pool (tests/worker_pool.py).

Forked once with its TF_CONFIG (tests/worker_pool.py), it runs worker
scripts (tests/workers/*.py) one after another in this process, as
TensorFlow's own `MultiProcessPoolRunner` runs test functions in long-lived
workers (tensorflow/python/distribute/multi_process_runner.py). Each request
is one JSON line: `{"id", "script" or "module", "args", "env", "cwd"}`.
The script (or module) runs as `__main__`, as `python script args...` (or
`python -m module args...`) would run it; then this worker writes
`{"id", "exit"}` as one line back. Requests come, and statuses go, over a
connection to the Unix socket its pool listens on (the path given as its only
argument), on which it first names itself by its slot (TFSCALE_SLOT).

Between scripts it restores what a script may change for the whole process
(environment, argv, working directory, temporary directory, the script's
absl flags, absl's verbosity, Keras's floatx, session and dtype policy) and
refuses to go on where it cannot (op determinism switched on): that scenario fails
and the pool is replaced, so no scenario sees what an earlier one left.

Python's collector stays out of the way as in a tfscale-train worker
(tfscale.launch.garbage_collection): TensorFlow is imported with it paused,
then frozen; after each scenario, once its garbage is collected, what
survived is frozen too, so the next scenario's full collections walk only
its own objects.
"""

import ctypes
import gc
import json
import os
import runpy
import signal
import socket
import sys
import tempfile
import traceback

from tfscale.launch import garbage_collection

# Before the imports below, which then find TensorFlow and Keras loaded.
garbage_collection.import_frozen("tfscale.strategy")

from absl import app
from absl import flags
from absl import logging
import keras
import tensorflow as tf

import tfscale
from tfscale._private import accessors

tfscale.Strategy  # loads the whole library once, for every scenario

# Exit status of a scenario that left process-wide state it cannot undo.
LEFT_STATE_EXIT = 70


_absl_run = app.run


def _run_absl_main(main, argv=None, **kwargs):
    """`absl.app.run` as a fresh process's first call runs it: at INFO
    unless the script's flags say otherwise (absl raises the verbosity only
    on its first call in a process)."""
    logging.set_verbosity(logging.INFO)
    _absl_run(main, argv, **kwargs)


FLAGS = flags.FLAGS


def _restore(environ, cwd, verbosity, flag_names, floatx):
    # The scenario's flags go: a later script may define the same name.
    for name in set(FLAGS) - flag_names:
        delattr(FLAGS, name)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    logging.set_verbosity(verbosity)
    keras.config.set_floatx(floatx)
    tf.config.run_functions_eagerly(False)
    keras.backend.clear_session()  # also unsets the dtype policy, as at start


def _freeze_survivors():
    """Moves what outlived the scenario (the libraries' caches, filled as
    scenarios use them) out of the next scenario's full collections, with
    the collector on as at start. Keras's `clear_session` in `_restore`
    has just collected the scenario's garbage, which is not frozen."""
    gc.freeze()
    gc.enable()


def run(request):
    """Runs one scenario; returns its exit status."""
    environ, cwd, verbosity = dict(os.environ), os.getcwd(), logging.get_verbosity()
    flag_names, floatx = set(FLAGS), keras.config.floatx()
    # TensorFlow has no switch back from op determinism: a scenario that
    # turns it on cannot be undone.
    determinism_before = accessors.op_determinism_enabled()
    script, module = request.get("script"), request.get("module")
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [script or module, *request["args"]]
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        if not isinstance(exit.code, (int, type(None))):
            print(exit.code, file=sys.stderr)
    except BaseException:  # the test reads this worker's output
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _restore(environ, cwd, verbosity, flag_names, floatx)
        _freeze_survivors()
    if accessors.op_determinism_enabled() and not determinism_before:
        print(f"pool worker: {script or module} left process-wide state that later "
              "scenarios would see: {'op determinism': True}; run it in its own "
              "processes (tests/multiworker.py launch_workers).", file=sys.stderr, flush=True)
        return code or LEFT_STATE_EXIT
    return code


def _die_with_the_test_process():
    """SIGKILL when the test process dies (Linux's PR_SET_PDEATHSIG): a worker
    waiting in a collective would otherwise outlive an interrupted run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the test process is already gone
        sys.exit(1)


def main():
    _die_with_the_test_process()
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.connect(sys.argv[1])
    requests, status = channel.makefile("r"), channel.makefile("w")
    status.write(f"{os.environ['TFSCALE_SLOT']}\n")
    status.flush()
    app.define_help_flags()  # absl's, not a scenario's: kept between scenarios
    app.run = _run_absl_main
    for line in requests:
        request = json.loads(line)
        what = request.get("module") or os.path.basename(request["script"])
        print(f"pool worker: scenario {request['id']}: {what} {' '.join(request['args'])}",
              file=sys.stderr, flush=True)
        code = run(request)
        status.write(json.dumps({"id": request["id"], "exit": code}) + "\n")
        status.flush()
        if code == LEFT_STATE_EXIT:
            break


if __name__ == "__main__":
    main()
