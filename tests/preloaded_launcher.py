"""`python tests/preloaded_launcher.py COMMAND...`: runs COMMAND, a
tfscale-launch or tfscale-bench (its console script, or `python -m` its
module), in this process, after forking from this process a preload
process of tfscale's core for it (`preload.hand_down`, launch/preload.py).

This process is forked from the pools' preload process (`multiworker.popen`),
which imported tfscale's core (tests/worker_pool.py, PRELOADED). A launcher
with `--preload=tfscale.strategy` takes that child as its preload process:
the launcher is the real one, and so are its workers, forked by a preload
process as `--preload` forks them, but no new interpreter imports
TensorFlow for them. A launcher of other modules or another environment
starts a preload process of its own, as it would anyway.
"""

import sys

import worker_pool
from tfscale.launch import preload

if __name__ == "__main__":
    command = sys.argv[1:]
    target = preload.python_target(command)
    if target is None:
        sys.exit(f"preloaded_launcher: {command[:1]} is no Python program")
    preload.hand_down(worker_pool.PRELOADED)
    preload.run_target(target)
