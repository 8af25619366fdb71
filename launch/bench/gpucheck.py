"""tfscale-bench gpucheck: what to run first on a GPU machine.

    tfscale-bench gpucheck                  # one worker per GPU TensorFlow sees
    tfscale-bench gpucheck --num_workers=4 --size=256MB

Starts one worker per GPU (through tfscale-launch, each given its GPU with
CUDA_VISIBLE_DEVICES as `--gpus_per_node` does), lists the GPUs each worker
sees, then on every worker all-reduces integer-valued float32 buffers once per
algorithm (ring, hierarchical, 2d, halving_doubling) through NCCL and through
TensorFlow's ring, checks every sum exactly, and prints the time and bus
bandwidth of each (a few timed calls after the checked one). With 4 or more
workers (an even number) they form two nodes of half the workers
(`--local_size`), so that hierarchical and 2d run their sub-groups: each an
NCCL communicator on the GPU's one NCCL stream, the launch-order hazard that
tfscale's one ordering chain per worker is there for
(`tfscale.collectives.implementation`). A hang there ends after
`--collective_timeout` with the workers' errors.

Without GPUs it says so in one line and exits 1 before starting a worker.
`--ring_only` runs only the ring half, on any machine (CPU workers too): it
checks the checking, not NCCL, and says so.
"""

import shutil
import tempfile

from absl import flags

from tfscale.launch.bench import cluster
from tfscale.launch.bench import report
from tfscale.launch.bench import stats

FLAGS = flags.FLAGS
ALGORITHMS = ("ring", "hierarchical", "2d", "halving_doubling")


def define_flags():
    """Defines gpucheck's flags (and tfscale-launch's, for its workers)."""
    from tfscale.launch import local

    local.define_flags()
    flags.DEFINE_string("size", "64MB", "Bytes of float32 per all-reduce (B, KB, "
                        "MB, GB: powers of 1024).")
    flags.DEFINE_integer("repeats", 3, "Timed calls per case after the checked "
                         "one.", lower_bound=1)
    flags.DEFINE_integer("local_size", None, "Workers per node for tfscale's "
                         "topology; unset: half the workers with 4 or more "
                         "(an even number), else one node.", lower_bound=1)
    flags.DEFINE_float("collective_timeout", 300, "Seconds a collective may "
                       "wait before the check fails (a hang ends there).")
    flags.DEFINE_bool("ring_only", False, "Run only the ring half, also on a "
                      "machine without GPUs: checks tfscale's checking on CPU "
                      "workers; NCCL is NOT checked.")


def main():
    """Checks every algorithm through NCCL and ring; prints the table."""
    num_gpus = _gpus_here()
    if not num_gpus and not FLAGS.ring_only:
        raise RuntimeError(_no_gpu_message())
    num_workers = FLAGS.num_workers
    if not FLAGS.ring_only and not FLAGS["num_workers"].present:
        num_workers = num_gpus
    if num_workers < 2:
        raise ValueError(
            f"gpucheck needs 2 or more workers (one per GPU); it would run "
            f"{num_workers} (TensorFlow sees {num_gpus} GPU(s) here).")
    gpus_per_node = None
    if not FLAGS.ring_only:
        if num_workers > num_gpus:
            raise ValueError(
                f"--num_workers={num_workers} but TensorFlow sees {num_gpus} "
                f"GPU(s) here: gpucheck runs one worker per GPU; give "
                f"--num_workers={num_gpus} or fewer.")
        gpus_per_node = num_workers
    size = stats.parse_sizes([FLAGS.size])[0]
    local_size = FLAGS.local_size
    if local_size is None and num_workers >= 4 and num_workers % 2 == 0:
        local_size = num_workers // 2
    implementations = ["ring"] if FLAGS.ring_only else ["nccl", "ring"]
    input_sets = [(stats.human_bytes(size), [[size // 4]])]
    spec = {
        "command": "gpucheck", "side": "tfscale", "input_sets": input_sets,
        "repeats": FLAGS.repeats, "warmup": 1, "local_size": local_size,
        "fusion_threshold_bytes": size, "collective_timeout": FLAGS.collective_timeout,
        "cost_model": None,
        "configs": [[f"{algorithm} via {implementation}", algorithm, None, implementation]
                    for implementation in implementations for algorithm in ALGORITHMS],
    }
    context = {
        "num_workers": num_workers, "local_size": local_size,
        "node_sizes": stats.node_sizes(num_workers, local_size),
        "emulate_nodes": None, "inter_node_rate": None, "link_rate": None,
        "mode": "sizes", "model": None,
    }
    work_dir = tempfile.mkdtemp(prefix="tfscale-gpucheck-")
    try:
        outputs = cluster.launch_workers(spec, work_dir, "gpucheck", num_workers=num_workers,
                                         emulate=False, gpus_per_node=gpus_per_node)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(f"# tfscale-bench gpucheck: {stats.describe_cluster(context)}")
    for output in sorted(outputs, key=lambda o: o["rank"]):
        print(describe_worker(output))
    rows = report.summarize([outputs], input_sets, context)  # raises if wrong
    print(table(rows))
    print(verdict(rows, num_workers, FLAGS.ring_only), flush=True)
    return rows


def _gpus_here():
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def _no_gpu_message():
    import tensorflow as tf

    build = "built with CUDA" if tf.test.is_built_with_cuda() else "built without CUDA"
    return (f"TensorFlow sees no GPU on this machine (tensorflow {tf.__version__}, "
            f"{build}), so there is no NCCL to check: run it on a GPU machine "
            "with pip install 'tensorflow[and-cuda]'; --ring_only checks only "
            "the ring half here.")


def describe_worker(output):
    """One line: what the worker was given, the GPUs it sees, its device."""
    gpus = output["gpus"]
    seen = (f"sees {len(gpus)} GPU(s): " + "; ".join(gpus)) if gpus else "sees no GPU"
    given = output["cuda_visible_devices"]
    given = "CUDA_VISIBLE_DEVICES unset" if given is None else f"CUDA_VISIBLE_DEVICES={given}"
    return f"worker {output['rank']}: {given}; {seen}; runs on {output['device']}"


def table(rows):
    """Algorithm, how it ran, time, bandwidths and #wrong of each row."""
    headers = ["algorithm", "via", "ran as", "size (B)", "time (ms)",
               "algbw (GB/s)", "busbw (GB/s)", "#wrong"]
    lines = [[r["algorithm"], r["implementation"], r.get("plan_algorithm", "-"),
              r["bytes"], r["seconds"] * 1e3, r["algbw"] / 1e9, r["busbw"] / 1e9,
              r["wrong"]] for r in rows]
    return stats.format_table(headers, lines, ["<", "<", "<"] + [">"] * 5)


def verdict(rows, num_workers, ring_only):
    """The last line: what was checked, and what was not."""
    line = (f"tfscale-bench gpucheck: all {len(rows)} sums exact on {num_workers} "
            f"workers ({', '.join(sorted({r['implementation'] for r in rows}))}; "
            "\"ran as\": the algorithm the plan ran, ring where a topology has no "
            "hierarchy); busbw = algbw * 2(n-1)/n.")
    if ring_only:
        line += " NCCL was NOT checked (--ring_only)."
    return line
