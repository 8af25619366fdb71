"""One worker process of a tfscale-bench subcommand: `python -m tfscale.launch.bench.worker SPEC`.

tfscale-launch starts N of these with their TF_CONFIG (cluster.launch_workers).
Each reads the spec its subcommand wrote, measures, and writes its result to
`<out_prefix>-<rank>.json` for the launching process to collect.
"""

import importlib
import json
import os
import sys

from tfscale.launch import garbage_collection

# spec["command"] -> the module whose `measure(spec)` this worker runs.
_MEASURES = {
    "allreduce": "tfscale.launch.bench.allreduce_worker",
    "train": "tfscale.launch.bench.train_worker",
    "gpucheck": "tfscale.launch.bench.gpucheck_worker",
    "scale": "tfscale.launch.bench.scale_worker",
    "fixedcost": "tfscale.launch.bench.fixedcost_worker",
}
# `tfscale-bench train --algorithms=jax`: Keras on JAX, without TensorFlow.
_JAX_TRAIN = "tfscale.launch.bench.jax_train_worker"


def main(spec_path):
    """Measures what the spec at `spec_path` asks for; writes the result."""
    with open(spec_path) as f:
        spec = json.load(f)
    name = _JAX_TRAIN if spec.get("kind") == "jax" else _MEASURES[spec["command"]]
    module = importlib.import_module(name)
    result = module.measure(spec)
    path = f"{spec['out_prefix']}-{result['rank']}.json"
    # Written whole or not at all: the launcher reads every worker's file.
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("Usage: python -m tfscale.launch.bench.worker SPEC_PATH (written by "
                 f"tfscale-bench). Received: {' '.join(sys.argv[1:]) or 'nothing'}")
    garbage_collection.skip_final_collection()
    main(sys.argv[1])
