"""Exit without the interpreter's last garbage collection.

At exit CPython collects the reference cycles of every object still alive;
once TensorFlow and Keras are imported that is a few million objects, and
the collection is most of a worker's exit. `python -m
tfscale.launch.fast_exit` measures a process that imported both and ran a
`fit`, from its last line to its end, with and without the collection.
Freezing the heap (`gc.freeze`, Python 3.7+) leaves those objects out of
it. Reference counting, `atexit` handlers (tfscale's flight recorder and
timeline among them) and TensorFlow's own shutdown still run; only objects
kept alive by a cycle are not finalized. tfscale-train and tfscale-bench's
workers write every file whole and close it before they return, so none of
theirs is among them. Instagram turned the same collection off for the same
cost ("Dismissing Python Garbage Collection at Instagram", Instagram
Engineering, 2017).
"""

import atexit
import gc
import statistics
import subprocess
import sys
import time


_registered = False


def skip_final_garbage_collection():
    """Makes this process skip the collection at its exit (once, however
    often it is called: a reused test worker runs tfscale-train many times)."""
    global _registered
    if not _registered:
        atexit.register(_freeze)
        _registered = True


def _freeze():
    gc.disable()
    gc.freeze()


_EXITING_PROCESS = """
import sys, time
import numpy as np, keras
from tfscale.launch import fast_exit
if sys.argv[1] == "skipped":
    fast_exit.skip_final_garbage_collection()
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
model.compile("sgd", "mse")
model.fit(np.zeros((32, 8)), np.zeros((32, 4)), verbose=0)
print(time.time(), flush=True)
"""


def exit_seconds(mode):
    """Seconds from a TensorFlow process's last line to its end."""
    process = subprocess.run([sys.executable, "-c", _EXITING_PROCESS, mode],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, check=True)
    ended = time.time()
    return ended - float(process.stdout.split()[-1])


def main(repeats=3):
    for mode in ("collected", "skipped"):
        seconds = [exit_seconds(mode) for _ in range(repeats)]
        print(f"exit with the last collection {mode}: median "
              f"{statistics.median(seconds):.2f} s of {repeats} "
              f"({', '.join(f'{s:.2f}' for s in seconds)})", flush=True)


if __name__ == "__main__":
    main()
