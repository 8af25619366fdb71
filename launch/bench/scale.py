"""tfscale-bench scale: start-up and memory per worker count, and a check
that every algorithm trains as one worker does at each count.

    tfscale-bench scale --worker_counts=2,4,8,16
    tfscale-bench scale --worker_counts=16 --num_workers=16 --emulate_nodes=4

(`--num_workers` is tfscale-launch's flag, checked against `--emulate_nodes`
when parsed; the counts launched are `--worker_counts`.)

For each count, N workers (through tfscale-launch; on emulated nodes where
`--emulate_nodes` divides N, else on loopback) each build a `tfscale.Strategy`
per algorithm and train a tiny BN-free model (`fit`, SGD with momentum, 8
updates) on a global batch they cannot share evenly (`--global_batch`, 37 by
default: 3 or 2 examples each on 16 workers). One worker alone trains the
same first, as the reference. Per count it prints:

- start-up: seconds from a worker's first line of Python to its first
  strategy being ready (imports, every worker connected), median and slowest;
- peak memory: each worker's peak resident memory (VmHWM), median and
  largest, and the sum over the workers;
- step: the median step time of the ring's second epoch (the default's when
  --algorithms leaves out ring; across nodes the default, auto, spends its
  first steps trying algorithms);
- per algorithm: whether every worker ended with bitwise-identical weights,
  and the largest difference from the one-worker weights.
"""

import os
import shutil
import statistics
import tempfile

import numpy as np
from absl import flags

from tfscale import communication_names
from tfscale.launch.bench import cluster

FLAGS = flags.FLAGS
DEFAULT = "default"  # CommunicationOptions() as a user builds it


def define_flags():
    """Defines scale's flags (and tfscale-launch's, for its workers)."""
    from tfscale.launch import local

    local.define_flags()
    flags.DEFINE_list("worker_counts", ["2", "4", "8", "16"],
                      "Numbers of workers to start, one launch each.")
    flags.DEFINE_list("algorithms", [DEFAULT, *communication_names.FIXED_ALGORITHMS],
                      f"{DEFAULT} (CommunicationOptions()) and/or tfscale "
                      f"algorithms ({', '.join(communication_names.ALGORITHMS)}).")
    flags.DEFINE_integer("global_batch", 37, "Examples per step over all "
                         "workers.", lower_bound=1)
    flags.DEFINE_integer("steps", 4, "Steps per epoch (2 epochs).", lower_bound=1)
    flags.DEFINE_string("output", None, "Write the rows as JSON here.")


def _flat(weights):
    return np.concatenate([np.ravel(np.asarray(w, np.float64)) for w in weights])


def summarize(reference, outputs, emulated_nodes):
    """One row from the one-worker reference and the N workers' outputs."""
    runs = outputs[0]["runs"]
    timed = runs.get("ring") or runs.get(DEFAULT) or next(iter(runs.values()))
    row = {
        "num_workers": len(outputs),
        "emulated_nodes": emulated_nodes,
        "topology": outputs[0]["topology"],
        "startup_seconds_median": statistics.median(o["startup_seconds"] for o in outputs),
        "startup_seconds_max": max(o["startup_seconds"] for o in outputs),
        "peak_memory_mib_median": statistics.median(
            o["peak_memory_bytes"] for o in outputs) / 2**20,
        "peak_memory_mib_max": max(o["peak_memory_bytes"] for o in outputs) / 2**20,
        "peak_memory_gib_sum": sum(o["peak_memory_bytes"] for o in outputs) / 2**30,
        "step_seconds": timed["step_seconds"],
        "algorithms": {},
    }
    for algorithm, run in outputs[0]["runs"].items():
        row["algorithms"][algorithm] = {
            "bitwise_identical": all(o["runs"][algorithm]["digest"] == run["digest"]
                                     for o in outputs),
            "max_abs_diff_vs_one_worker": float(np.max(np.abs(
                _flat(run["weights"]) - _flat(reference["runs"][algorithm]["weights"])))),
        }
    return row


def table(rows):
    lines = ["| workers | nodes | start-up s (median / slowest) | peak MiB per worker "
             "(median / largest) | GiB all workers | step s | algorithms: bitwise "
             "on every worker; max abs diff vs 1 worker |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        checks = "; ".join(
            f"{name} {'yes' if a['bitwise_identical'] else 'NO'} "
            f"{a['max_abs_diff_vs_one_worker']:.1e}" for name, a in r["algorithms"].items())
        lines.append(
            f"| {r['num_workers']} | {r['emulated_nodes'] or 'loopback'} | "
            f"{r['startup_seconds_median']:.1f} / {r['startup_seconds_max']:.1f} | "
            f"{r['peak_memory_mib_median']:.0f} / {r['peak_memory_mib_max']:.0f} | "
            f"{r['peak_memory_gib_sum']:.1f} | {r['step_seconds']:.4f} | {checks} |")
    return "\n".join(lines)


def main():
    import json

    counts = []
    for value in FLAGS.worker_counts:
        if not value.isdigit() or int(value) < 2:
            raise ValueError("--worker_counts takes integers >= 2. "
                             f"Received: --worker_counts={','.join(FLAGS.worker_counts)}")
        counts.append(int(value))
    allowed = (DEFAULT, *communication_names.ALGORITHMS)
    for name in FLAGS.algorithms:
        if name not in allowed:
            raise ValueError(f"--algorithms: {name!r} is unknown; choose from "
                             f"{', '.join(allowed)}. Received: --algorithms={name}")
    spec = {"command": "scale", "algorithms": FLAGS.algorithms,
            "global_batch": FLAGS.global_batch, "steps": FLAGS.steps}
    work_dir = tempfile.mkdtemp(prefix="tfscale-bench-scale-")
    try:
        (reference,) = cluster.launch_workers(spec, work_dir, "reference",
                                              num_workers=1, emulate=False)
        rows = []
        for count in counts:
            nodes = FLAGS.emulate_nodes
            emulate = bool(nodes) and count >= nodes and count % nodes == 0
            outputs = cluster.launch_workers(spec, work_dir, f"n{count}",
                                             num_workers=count, emulate=emulate)
            rows.append(summarize(reference, outputs, nodes if emulate else None))
            print(table(rows[-1:]), flush=True)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(f"\nglobal batch {FLAGS.global_batch}, {2 * FLAGS.steps} updates\n"
          + table(rows), flush=True)
    if FLAGS.output:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
        with open(FLAGS.output, "w") as f:
            json.dump(rows, f, indent=1)
