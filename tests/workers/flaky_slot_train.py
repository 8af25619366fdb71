"""Runs `python -m tfscale.launch.train ARGS` as a worker whose slot may be broken.

Usage: flaky_slot_train.py SLOT MODEL_DIR FAIL_AT_STEP -- ARGS...
  The worker of slot SLOT (TFSCALE_SLOT) in the first launch trains until
  MODEL_DIR holds the checkpoint of step FAIL_AT_STEP, then SIGKILLs its
  training process and itself (a machine dying); in every relaunch
  (TFSCALE_RESTART_COUNT >= 1) it exits 1 at once (the machine stays
  broken). Every other worker runs tfscale-train.
"""

import json
import os
import signal
import subprocess
import sys
import time


def saved_step(directory):
    """The newest checkpoint's step in `directory` (0: none yet)."""
    try:
        with open(os.path.join(directory, "state.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError):
        return 0


slot, model_dir, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
train = [sys.executable, "-m", "tfscale.launch.train", *sys.argv[5:]]
if os.environ["TFSCALE_SLOT"] != slot:
    os.execv(sys.executable, train)
if os.environ["TFSCALE_RESTART_COUNT"] != "0":
    print(f"slot {slot}: this machine is broken", flush=True)
    sys.exit(1)
child = subprocess.Popen(train)
while child.poll() is None and saved_step(model_dir) < fail_at:
    time.sleep(0.05)
print(f"slot {slot}: dying after the checkpoint of step {saved_step(model_dir)}",
      flush=True)
child.kill()
os.kill(os.getpid(), signal.SIGKILL)
