"""The cluster side of `allreduce` and `train`: their shared flags, the
configurations they compare, and starting workers through tfscale-launch.

A subcommand writes a spec (JSON) for its workers; `launch_workers` starts
them (`python -m tfscale.launch.bench.worker SPEC`, see worker.py) and returns what
each wrote to `<out_prefix>-<rank>.json`.
"""

import json
import os
import sys

from absl import flags

from tfscale import communication_names
from tfscale.launch.bench import stats

_MiB = 1024 * 1024
STOCK = "stock"  # TF's own MultiWorkerMirroredStrategy all-reduce
# train only: every worker trains alone and all wait for the slowest at each
# step's end (one 4-byte all-reduce); no gradient is sent. Its step is what
# synchronous training costs with a free link, on the same shared cores.
LOCKSTEP = "lockstep"
# train only: Keras 3 on JAX with keras.distribution.DataParallel, the same
# model, data and optimizer (jax_train_worker.py); needs tfscale[jax].
JAX = "jax"
NO_COMPRESSION = "none"  # --compression value: float32 on the wire

FLAGS = flags.FLAGS


def define_flags():
    """Defines the flags of a subcommand that starts workers.

    tfscale-launch's own flags (--num_workers, --timeout, --grace_seconds,
    --emulate_nodes, --inter_node_rate, ...) come with launch.local.
    """
    from tfscale.launch import local

    local.define_flags()
    flags.DEFINE_list(
        "algorithms", [STOCK, *communication_names.FIXED_ALGORITHMS],
        f"{STOCK} (TF's own all-reduce) and/or tfscale algorithms "
        f"({', '.join(communication_names.ALGORITHMS)}); train also {LOCKSTEP} (workers "
        "wait for each other every step and send no gradients: the floor of "
        f"synchronous training) and {JAX} (Keras 3 on JAX with keras.distribution."
        "DataParallel: the same model, data and optimizer; needs tfscale[jax]).")
    flags.DEFINE_list(
        "compression", [NO_COMPRESSION],
        "Wire formats for the tfscale algorithms: "
        f"{', '.join((NO_COMPRESSION, *communication_names.COMPRESSIONS))} (train "
        f"also {communication_names.POWERSGD}); each algorithm runs with each.")
    flags.DEFINE_integer(
        "local_size", None,
        "Workers per node for tfscale's topology; unset: by host (one node on "
        "loopback, one per --emulate_nodes node).", lower_bound=1)
    flags.DEFINE_integer("fusion_threshold_bytes", 32 * _MiB,
                         "tfscale's fusion buffer size.", lower_bound=0)
    flags.DEFINE_float("collective_timeout", 900,
                       "Seconds a tfscale collective may wait.")


def configs(more_compressions=(), more_baselines=()):
    """The configurations --algorithms and --compression ask for.

    Args:
        more_compressions: compressions this subcommand takes besides the
            wire formats (train: PowerSGD, which compresses whole gradients,
            not single buffers).
        more_baselines: configurations without an algorithm or compression
            that this subcommand takes besides stock (train: lockstep).

    Returns:
        `[(name, algorithm, compression)]`: stock and the other baselines
        first (if asked for; they have no compression), then each tfscale
        algorithm with each compression (None: float32 on the wire).

    Raises:
        ValueError: naming the flag and the values it takes.
    """
    baselines = (STOCK, *more_baselines)
    allowed = (*baselines, *communication_names.ALGORITHMS)
    if not FLAGS.algorithms:
        raise ValueError(f"--algorithms is empty; choose from {', '.join(allowed)}.")
    for name in FLAGS.algorithms:
        if name not in allowed:
            raise ValueError(f"--algorithms: {name!r} is unknown; choose from "
                             f"{', '.join(allowed)}. Received: --algorithms={name}")
    compressions = []
    known = (*communication_names.COMPRESSIONS, *more_compressions)
    for value in FLAGS.compression:
        if value not in (NO_COMPRESSION, *known):
            raise ValueError(
                f"--compression values must be {NO_COMPRESSION} or one of "
                f"{', '.join(known)}. Received: --compression={value}")
        compressions.append(None if value == NO_COMPRESSION else value)
    out = [(name, name, None) for name in baselines if name in FLAGS.algorithms]
    for compression in compressions:
        for algorithm in FLAGS.algorithms:
            if algorithm not in baselines:
                name = algorithm + (f"+{compression}" if compression else "")
                out.append((name, algorithm, compression))
    return out


def context():
    """What every row records about the cluster."""
    n = FLAGS.num_workers
    emulated = bool(FLAGS.emulate_nodes)
    return {
        "num_workers": n,
        "local_size": FLAGS.local_size,
        "node_sizes": stats.node_sizes(n, FLAGS.local_size, FLAGS.emulate_nodes),
        "emulate_nodes": FLAGS.emulate_nodes,
        "inter_node_rate": FLAGS.inter_node_rate if emulated else None,
        "link_rate": (stats.parse_rate(FLAGS.inter_node_rate)
                      if emulated and FLAGS.inter_node_rate else None),
    }


def _worker_env():
    """Workers import `launch`, `tfscale` and `models` from this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:  # once: later launches see the environment unchanged
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, *paths) if p)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def launch_workers(spec, work_dir, name, num_workers=None, emulate=True,
                   gpus_per_node=None):
    """Runs workers of `spec` via tfscale-launch and returns their outputs.

    Args:
        spec: JSON-serializable dict; `spec["command"]` picks the worker
            (see worker.py).
        work_dir: directory for the spec file and the workers' outputs.
        name: names this launch in file names and messages.
        num_workers: None: --num_workers.
        emulate: False runs on loopback even with --emulate_nodes.
        gpus_per_node: give each worker one GPU (tfscale-launch's
            `--gpus_per_node`); None: one each if `--gpus_per_node` is set,
            else every worker sees what this process sees.

    Returns:
        One output (parsed JSON) per rank.

    Raises:
        RuntimeError: if the launch fails or a worker writes nothing.
    """
    from tfscale.launch import local

    num_workers = num_workers or FLAGS.num_workers
    spec = dict(spec, out_prefix=os.path.join(work_dir, name))
    spec_path = os.path.join(work_dir, f"{name}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    _worker_env()
    emulation = {}
    if emulate and FLAGS.emulate_nodes:
        emulation = dict(
            emulate_nodes=FLAGS.emulate_nodes, inter_node_rate=FLAGS.inter_node_rate,
            inter_node_burst=FLAGS.inter_node_burst,
            inter_node_latency=FLAGS.inter_node_latency)
    if gpus_per_node is None and FLAGS.gpus_per_node:
        # One GPU per worker, whatever this launch's size (a one-worker
        # baseline included): as many GPUs per node as workers on it.
        gpus_per_node = num_workers // (FLAGS.emulate_nodes if emulation else 1)
    command = [sys.executable, "-m", "tfscale.launch.bench.worker", spec_path]
    print(f"tfscale-bench: launching {num_workers} worker(s): {name}", flush=True)
    code = local.launch(command, num_workers, timeout=FLAGS.timeout,
                        grace_seconds=FLAGS.grace_seconds, isolate=FLAGS.isolate,
                        gpus_per_node=gpus_per_node, **emulation,
                        # Keras on JAX must not find Keras imported on TensorFlow.
                        preload_modules=() if spec.get("kind") == "jax" else FLAGS.preload)
    if code != 0:
        raise RuntimeError(
            f"The {name} workers failed (exit code {code}); their output is above.")
    outputs = []
    for rank in range(num_workers):
        path = f"{spec['out_prefix']}-{rank}.json"
        if not os.path.exists(path):
            raise RuntimeError(f"Worker {rank} of {name} wrote no result ({path}).")
        with open(path) as f:
            outputs.append(json.load(f))
    return outputs
