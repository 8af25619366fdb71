"""What worker scripts use to hand results back to the test process."""

import json
import os

from tfscale.launch import garbage_collection

# Every worker script imports this module: each exits in a fraction of a
# second instead of seconds, as tfscale-train does
# (tfscale.launch.garbage_collection).
garbage_collection.skip_final_collection()


def worker_index():
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    return config.get("task", {}).get("index", 0)


def report(value):
    """Writes `value` (JSON-serializable) as this worker's result."""
    path = os.path.join(
        os.environ["TFSCALE_TEST_RESULTS"], f"worker-{worker_index()}.json"
    )
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)
