"""Python's garbage collector in a TensorFlow process: out of the way of
TensorFlow's few hundred thousand module objects, which live until exit.

CPython's full collection walks every tracked object. Once TensorFlow and
Keras are imported, that is ~450,000 objects that never become garbage, so:

- importing them with the collector on runs full collections over a heap
  that only grows;
- the first full collections after the import, while the first model is
  built, traced and fitted, walk them again;
- the last collection at exit walks them once more.

`import_frozen` imports with the collector paused, then moves everything
alive into the permanent generation (`gc.freeze`, Python 3.7+), which later
collections skip; `skip_final_collection` does the same at exit. Reference
counting, `atexit` handlers (tfscale's flight recorder and timeline among
them) and TensorFlow's own shutdown still run; only objects kept alive by a
cycle at exit are not finalized, and tfscale-train writes every file whole
and closes it before it returns. Instagram froze its heap for the same
reason ("Dismissing Python Garbage Collection at Instagram", Instagram
Engineering, 2017); CPython documents `gc.freeze` for it.

`python -m tfscale.launch.garbage_collection` measures all three in fresh
processes, each way.
"""

import atexit
import gc
import importlib
import statistics
import subprocess
import sys
import time

_frozen_imports = False
_exit_registered = False


def import_frozen(*names):
    """Imports the modules `names` with the collector paused and freezes the
    heap after them; returns the last. The freeze happens once per process (a
    reused test worker runs tfscale-train many times; a second freeze would
    keep the garbage of earlier runs for good)."""
    global _frozen_imports
    if _frozen_imports:
        return [importlib.import_module(name) for name in names][-1]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        module = [importlib.import_module(name) for name in names][-1]
        gc.freeze()
        _frozen_imports = True
        return module
    finally:
        if was_enabled:
            gc.enable()


def skip_final_collection():
    """Makes this process skip the collection at its exit (registered once,
    however often asked)."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(_freeze_at_exit)
        _exit_registered = True


def _freeze_at_exit():
    gc.disable()
    gc.freeze()


# One process of the measurement: argv[1] is "tuned" or "default".
_MEASURED_PROCESS = """
import gc, sys, time
from tfscale.launch import garbage_collection
tuned = sys.argv[1] == "tuned"
start = time.perf_counter()
if tuned:
    garbage_collection.import_frozen("tfscale.launch.training")
else:
    import tfscale.launch.training
imported = time.perf_counter() - start
collecting, began = [0.0], [0.0]
gc.callbacks.append(lambda phase, info: (
    began.__setitem__(0, time.perf_counter()) if phase == "start"
    else collecting.__setitem__(0, collecting[0] + time.perf_counter() - began[0])))
import keras, numpy as np
start = time.perf_counter()
for seed in range(3):  # as a test or a study builds, traces and fits model after model
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(np.zeros((256, 8, 8, 1)), np.zeros(256), batch_size=32, epochs=2, verbose=0)
    keras.backend.clear_session()
fitted = time.perf_counter() - start
if tuned:
    garbage_collection.skip_final_collection()
print(imported, fitted, collecting[0], time.time(), flush=True)
"""


def measure(mode):
    """(import s, fit s, of which collecting s, exit s) of one fresh process."""
    process = subprocess.run([sys.executable, "-c", _MEASURED_PROCESS, mode],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, check=True)
    ended = time.time()
    imported, fitted, collecting, last_line = map(float, process.stdout.split()[-4:])
    return imported, fitted, collecting, ended - last_line


def main(repeats=3):
    """Alternates default and tuned processes (a shared machine's load
    drifts) and prints the medians."""
    seconds = {"default": [], "tuned": []}
    for _ in range(repeats):
        for mode in seconds:
            seconds[mode].append(measure(mode))
    for mode, runs in seconds.items():
        imported, fitted, collecting, exited = (statistics.median(c) for c in zip(*runs))
        print(f"{mode:7}: import {imported:.2f} s; three small fits {fitted:.2f} s, "
              f"of which collecting {collecting:.2f} s; exit {exited:.2f} s "
              f"(medians of {repeats} processes)", flush=True)


if __name__ == "__main__":
    main()
