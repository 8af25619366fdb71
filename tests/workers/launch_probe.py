"""A worker for the launcher tests: prints its TF_CONFIG, slot, restart count,
CUDA_VISIBLE_DEVICES and TF_NUM_INTRAOP_THREADS, whether it was forked from
a process that preloaded tfscale.launch.ports and whether it leads its own
session, then obeys argv.

    launch_probe.py ok            exit 0
    launch_probe.py fail INDEX    worker INDEX exits 3 at once, the others sleep
    launch_probe.py sleep         every worker sleeps (for the timeout test),
                                  each also starting a child that sleeps
    launch_probe.py bind          binds its TF_CONFIG address, as a server does
    launch_probe.py strategy      builds tfscale.Strategy (TensorFlow's gRPC
                                  server binds its port) and prints the sum of
                                  index + 1 over the workers
    launch_probe.py flaky SLOT N [kill]
                                  in the first N launches (TFSCALE_RESTART_COUNT
                                  < N) the worker of slot SLOT exits 3 (with
                                  `kill`: SIGKILLs itself) and the others sleep,
                                  each with a sleeping child; later launches
                                  exit 0
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
slot = os.environ.get("TFSCALE_SLOT")
restart = os.environ.get("TFSCALE_RESTART_COUNT")
print(f"pid={os.getpid()} tf_config={json.dumps(config)}", flush=True)
print(f"slot={slot} restart={restart}", flush=True)
print(f"cuda_visible_devices={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
      flush=True)
print(f"intra_op_threads={os.environ.get('TF_NUM_INTRAOP_THREADS', '(unset)')}", flush=True)
# Imported before this script ran: forked from `--preload=tfscale.launch.ports`.
print(f"preloaded={'tfscale.launch.ports' in sys.modules} "
      f"session_leader={os.getsid(0) == os.getpid()}", flush=True)
mode = sys.argv[1]
if mode == "ok":
    sys.exit(0)
if mode == "bind":  # OSError "Address already in use" if the port is taken
    host, port = config["cluster"]["worker"][index].rsplit(":", 1)
    socket.create_server((host, int(port)))
    sys.exit(0)
if mode == "strategy":
    import tensorflow as tf
    import tfscale

    strategy = tfscale.Strategy()
    total = strategy.reduce(
        "SUM", strategy.run(lambda: tf.constant(index + 1.0)), axis=None)
    print(f"sum={float(total)}", flush=True)
    sys.exit(0)
if mode == "flaky":
    if int(restart) >= int(sys.argv[3]):
        sys.exit(0)
    if int(slot) == int(sys.argv[2]):
        time.sleep(1.5)  # the test reads every worker's lines of each launch
        print("failing on purpose", flush=True)
        if sys.argv[4:] == ["kill"]:
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3)
if mode == "fail" and index == int(sys.argv[2]):
    print("failing on purpose", flush=True)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"child={child.pid}", flush=True)
time.sleep(600)
