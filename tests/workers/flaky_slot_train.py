"""Runs `python -m tfscale.launch.train ARGS` as a worker whose slot may be broken.

Usage: flaky_slot_train.py SLOT MODEL_DIR FAIL_AT_STEP -- ARGS...
  The worker of slot SLOT (TFSCALE_SLOT) in the first launch trains until
  MODEL_DIR holds the checkpoint of step FAIL_AT_STEP, then SIGKILLs itself
  (a machine dying); in every relaunch (TFSCALE_RESTART_COUNT >= 1) it exits
  1 at once (the machine stays broken). Every other worker runs
  tfscale-train. Each trains in this process, as `python -m` would run it,
  so that a worker forked from the launcher's `--preload` imports nothing
  again.
"""

import json
import os
import runpy
import signal
import sys
import threading
import time


def saved_step(directory):
    """The newest checkpoint's step in `directory` (0: none yet)."""
    try:
        with open(os.path.join(directory, "state.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError):
        return 0


def die(model_dir):
    print(f"slot {slot}: dying after the checkpoint of step {saved_step(model_dir)}",
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die_after_the_checkpoint(model_dir, step):
    while saved_step(model_dir) < step:
        time.sleep(0.05)
    die(model_dir)


slot, model_dir, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
dying = os.environ["TFSCALE_SLOT"] == slot
if dying and os.environ["TFSCALE_RESTART_COUNT"] != "0":
    print(f"slot {slot}: this machine is broken", flush=True)
    sys.exit(1)
if dying:
    threading.Thread(target=die_after_the_checkpoint, args=(model_dir, fail_at),
                     daemon=True).start()
sys.argv = ["tfscale-train", *sys.argv[5:]]
try:
    runpy.run_module("tfscale.launch.train", run_name="__main__", alter_sys=True)
finally:
    if dying:  # training ended before its checkpoint: the machine dies anyway
        die(model_dir)
