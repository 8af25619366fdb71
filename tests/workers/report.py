"""What worker scripts use to hand results back to the test process."""

import json
import os
import time

from tfscale.launch import garbage_collection

# Every worker script imports this module: each exits in a fraction of a
# second instead of seconds, as tfscale-train does
# (tfscale.launch.garbage_collection).
garbage_collection.skip_final_collection()


def worker_index():
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    return config.get("task", {}).get("index", 0)


def result_path(index):
    """Where worker `index` writes its result (`report`)."""
    return os.path.join(os.environ["TFSCALE_TEST_RESULTS"], f"worker-{index}.json")


def wait_for_file(path, seconds):
    """Waits until `path` exists, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)


def report(value):
    """Writes `value` (JSON-serializable) as this worker's result."""
    path = result_path(worker_index())
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)
