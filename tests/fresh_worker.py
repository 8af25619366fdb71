"""One fresh worker process of `multiworker.launch_workers`:
`python tests/fresh_worker.py SCRIPT ARGS...` runs SCRIPT as
`python SCRIPT ARGS...` would, after importing TensorFlow, Keras and
tfscale the way tfscale-train does: with Python's garbage collector paused,
then frozen (tfscale.launch.garbage_collection). A fresh test worker then
starts and builds its first models as a tfscale-train worker does, without
full collections over TensorFlow's modules.
"""

import os
import runpy
import sys

from tfscale.launch import garbage_collection

if __name__ == "__main__":
    # The strategy module pulls in TensorFlow, Keras and tfscale's core, and
    # defines no absl flag a script could also define.
    garbage_collection.import_frozen("tfscale.strategy")  # multiworker.FRESH_WORKER_IMPORTS
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")
