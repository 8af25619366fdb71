r"""tfscale-bench fixedcost: what one collective costs before any byte counts.

    tfscale-bench fixedcost --worker_counts=2,4,8
    tfscale-bench fixedcost --worker_counts=8 --emulate_nodes=2 --inter_node_rate=200mbit

All-reduces one float32 (4 bytes) on each number of workers of
--worker_counts and times, per call (median over --repeats calls, the
slowest worker of each), with the method:

- floor: a `tf.function` call without any collective (Python to the
  runtime and back, reading the result).
- bare ops (fixedcost_worker.bare_cases), on the collective runtime that
  MultiWorkerMirroredStrategy configured, without any strategy code:
  `CollectiveReduceV2` with the same instance key every call, with a new key
  every call (what strategies do: the difference is TensorFlow resolving a
  new instance), `CollectiveGatherV2` (the ring all-gather, n - 1 steps
  against the all-reduce's 2 (n - 1)) with a local sum, and ten chained
  all-reduces in one call (one op without the call around it).
- stock: MultiWorkerMirroredStrategy's all-reduce as Keras calls it
  (`strategy.run`, `ReplicaContext.all_reduce`).
- each tfscale algorithm of --algorithms through `tfscale.Strategy`, the
  same call.

So: stock - bare op (new key) is MWMS's own work around the op; tfscale
ring - bare op (new key) is tfscale's (the routing, the plan, the watchdog
and flight recorder around each op); bare op (same key) - floor is
TensorFlow's collective executor and the ring's steps over gRPC, whose cost
per step the gather/all-reduce pair separates; the chain's per-op time is an
op without the Python call. Rows are per worker count; on loopback the
workers are split into 2 nodes (--local_size unset) so that hierarchical and
2d run as on 2 machines.
"""

import shutil
import tempfile

from absl import flags

from tfscale.launch.bench import cluster
from tfscale.launch.bench import stats

FLAGS = flags.FLAGS


def define_flags():
    cluster.define_flags()
    flags.DEFINE_list("worker_counts", ["2", "4", "8"],
                      "Cluster sizes to measure, one launch per side each.")
    flags.DEFINE_integer("repeats", 30, "Timed calls per case.", lower_bound=1)
    flags.DEFINE_integer("warmup", 3, "Untimed calls per case before the result check.",
                         lower_bound=1)
    flags.DEFINE_string("output", None, "Write the rows as JSON here.")


def _worker_counts():
    try:
        counts = [int(c) for c in FLAGS.worker_counts]
    except ValueError:
        raise ValueError("--worker_counts takes integers, e.g. 2,4,8. "
                         f"Received: {','.join(FLAGS.worker_counts)}") from None
    for count in counts:
        if count < 2:
            raise ValueError(f"--worker_counts: each needs >= 2 workers. Received: {count}")
        if FLAGS.emulate_nodes and count % FLAGS.emulate_nodes:
            raise ValueError(f"--worker_counts: {count} workers do not divide into "
                             f"--emulate_nodes={FLAGS.emulate_nodes} nodes.")
    return counts


def _local_size(count):
    if FLAGS.local_size or FLAGS.emulate_nodes:
        return FLAGS.local_size  # emulated: by host, one per node
    return max(1, count // 2)


def main():
    counts = _worker_counts()
    configs = cluster.configs()
    rows = []
    work_dir = tempfile.mkdtemp(prefix="tfscale-bench-fixedcost-")
    try:
        for count in counts:
            spec = {"command": "fixedcost", "repeats": FLAGS.repeats,
                    "warmup": FLAGS.warmup, "local_size": _local_size(count),
                    "fusion_threshold_bytes": FLAGS.fusion_threshold_bytes,
                    "collective_timeout": FLAGS.collective_timeout, "cost_model": None}
            sides = [(cluster.STOCK, [])]
            tfscale_configs = [[name, algorithm, compression, "auto"]
                               for name, algorithm, compression in configs
                               if algorithm != cluster.STOCK]
            if tfscale_configs:
                sides.append(("tfscale", tfscale_configs))
            for side, side_configs in sides:
                outputs = cluster.launch_workers(
                    dict(spec, side=side, configs=side_configs), work_dir,
                    f"{side}-{count}", num_workers=count)
                rows += summarize(outputs, count)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(header(counts))
    print(table(rows, counts), flush=True)
    if FLAGS.output:
        stats.write_json({"context": cluster.context(), "rows": rows}, FLAGS.output)
        print(f"tfscale-bench: wrote {len(rows)} rows to {FLAGS.output}")
    return rows


def summarize(outputs, count):
    """One row per case: the median over repeats of the slowest worker's
    time, per op for chained ops; wrong results stop the bench."""
    by_case = {}
    for output in outputs:
        for row in output["rows"]:
            if row["wrong"]:
                raise RuntimeError(
                    f"{row['label']} on {count} workers: worker {row['rank']} got "
                    f"{row['wrong']} wrong element(s); no time is reported.")
            by_case.setdefault(row["label"], []).append(row)
    rows = []
    for label, worker_rows in by_case.items():
        seconds, _ = stats.median_of_max([r["repeat_seconds"] for r in worker_rows])
        ops = worker_rows[0].get("ops_per_call") or 1
        rows.append({"case": label, "kind": worker_rows[0]["kind"], "num_workers": count,
                     "ms": seconds * 1e3 / ops,
                     "plan": worker_rows[0].get("plan")})
    return rows


def header(counts):
    if FLAGS.emulate_nodes:
        where = f"{FLAGS.emulate_nodes} emulated nodes, inter-node link {FLAGS.inter_node_rate}"
    elif FLAGS.local_size:
        where = f"loopback (127.0.0.1), nodes of {FLAGS.local_size} for tfscale"
    else:
        where = "loopback (127.0.0.1), workers split into 2 nodes for tfscale"
    return (f"# tfscale-bench fixedcost: all-reduce of one float32 (4 bytes); "
            f"{', '.join(map(str, counts))} workers; {where}; median over "
            f"{FLAGS.repeats} calls of the slowest worker, after {FLAGS.warmup} "
            "warm-up calls; ms per call (per op for the chain)")


def table(rows, counts):
    cases = list(dict.fromkeys(r["case"] for r in rows))
    kinds = {r["case"]: r["kind"] for r in rows}
    ms = {(r["case"], r["num_workers"]): r["ms"] for r in rows}
    headers = ["case", "kind"] + [f"{c} workers (ms)" for c in counts]
    body = [[case, kinds[case]] + [
        (f"{ms[(case, c)]:.2f}" if (case, c) in ms else "-") for c in counts]
        for case in cases]
    return stats.format_table(headers, body, align=["<", "<"] + [">"] * len(counts))
