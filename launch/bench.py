r"""tfscale-bench: all-reduce and training benchmarks, and a cost-model projection.

    tfscale-bench allreduce --num_workers=4 --local_size=2 \
        --sizes=64KB,1MB,16MB --algorithms=stock,ring,hierarchical,2d,hybrid \
        --repeats=5 --output=docs/bench/allreduce.json --plot
    tfscale-bench allreduce --num_workers=4 --emulate_nodes=2 \
        --inter_node_rate=200mbit --gradients=resnet50 --compression=none,bfloat16
    tfscale-bench project --measurements=docs/bench/allreduce.json
    tfscale-bench train --model=resnet50 --num_workers=4 --image_size=64 --steps=5

`allreduce` works as nccl-tests do: it starts --num_workers workers itself
(through tfscale-launch's `launch`, so --emulate_nodes/--inter_node_rate place
them in emulated nodes), each all-reduces integer-valued float32 buffers with
every algorithm, checks each result against the exact sum, then times
--repeats calls; the table gives the median, algbw and busbw. "stock" is a
plain MultiWorkerMirroredStrategy reducing the way Keras does; it runs in its
own launch (one strategy per process), the tfscale algorithms in another.
--gradients all-reduces a model's real gradient list instead of single
buffers. `train` and `project` are described in launch/bench_train.py and
launch/bench_project.py.
"""

import json
import os
import shutil
import sys
import tempfile

from absl import app
from absl import flags

from launch import bench_report
from launch import bench_stats
from launch import local  # --num_workers, --timeout, --emulate_nodes, ...

_MiB = 1024 * 1024
_COMMANDS = ("allreduce", "project", "train")

flags.DEFINE_list("sizes", ["64KB", "1MB", "4MB", "16MB"],
                  "allreduce: buffer sizes (B, KB, MB, GB: powers of 1024).")
flags.DEFINE_list("algorithms", ["stock", "ring", "hierarchical", "2d", "hybrid"],
                  "allreduce/train: stock and/or tfscale algorithms "
                  "(ring, hierarchical, 2d, hybrid).")
flags.DEFINE_list("compression", ["none"],
                  "allreduce/train: wire formats for the tfscale algorithms: "
                  "none, bfloat16, float16; each algorithm runs with each.")
flags.DEFINE_integer("repeats", 5, "allreduce: timed calls per case.", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "allreduce: untimed calls per case before "
                     "the result check.", lower_bound=1)
flags.DEFINE_integer("rounds", 1, "allreduce: launches per side (stock, "
                     "tfscale), alternating; repeats of all rounds are pooled.",
                     lower_bound=1)
flags.DEFINE_integer("local_size", None,
                     "Workers per node for tfscale's topology; unset: by host "
                     "(one node on loopback, one per --emulate_nodes node).",
                     lower_bound=1)
flags.DEFINE_enum("gradients", None, ["resnet50", "alexnet_bn"],
                  "allreduce: all-reduce this model's trainable-variable shapes "
                  "(float32, forward order) instead of --sizes.")
flags.DEFINE_integer("bytes_per_pack", 32 * _MiB,
                     "allreduce --gradients: stock also runs with "
                     "CommunicationOptions(bytes_per_pack=this); 0: not.",
                     lower_bound=0)
flags.DEFINE_integer("fusion_threshold_bytes", 32 * _MiB,
                     "tfscale's fusion buffer size.", lower_bound=0)
flags.DEFINE_string("cost_model", None,
                    "JSON of a fitted CostModel (as `project` writes) for "
                    "tfscale's chunk counts and hybrid threshold; unset: the default.")
flags.DEFINE_float("collective_timeout", 900, "Seconds a tfscale collective may wait.")
flags.DEFINE_string("output", None, "Write the rows as JSON here.")
flags.DEFINE_bool("plot", False, "Also write a PNG next to --output "
                  "(allreduce: busbw vs size; train: images/s).")
flags.DEFINE_string("measurements", None,
                    "project: JSON rows of `allreduce --sizes=...` to fit the cost model on.")
flags.DEFINE_string("fitted_output", None, "project: write the fitted cost model here "
                    "(JSON, for allreduce --cost_model).")
flags.DEFINE_list("gpus", ["8", "16", "32", "64", "128", "256", "512", "1024", "2048"],
                  "project: GPU counts to project to.")
flags.DEFINE_float("alpha_scale", 1.0, "project: multiply the paper hardware's "
                   "latencies by this (sensitivity check).", lower_bound=0)
flags.DEFINE_enum("model", "resnet50", ["resnet50", "alexnet_bn"], "train: model.")
flags.DEFINE_integer("image_size", 64, "train: side of the square synthetic images "
                     "(alexnet_bn needs >= 67).", lower_bound=32)
flags.DEFINE_integer("fc_units", 4096, "train --model=alexnet_bn: fully connected "
                     "width (4096 as published).", lower_bound=1)
flags.DEFINE_integer("per_worker_batch", 16, "train: images per worker per step.",
                     lower_bound=1)
flags.DEFINE_integer("steps", 5, "train: timed steps per run.", lower_bound=1)
flags.DEFINE_integer("warmup_steps", 2, "train: untimed steps per run (graph "
                     "building).", lower_bound=1)
flags.DEFINE_list("precisions", ["float32", "mixed_bfloat16"],
                  "train: Keras global dtype policies to compare.")
flags.DEFINE_string("worker_spec", None, "Internal: run as a worker of this spec.")
FLAGS = flags.FLAGS


def _worker_env():
    """Workers import `launch`, `tfscale` and `models` from this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def launch_workers(spec, work_dir, name, num_workers=None, emulate=True):
    """Runs `num_workers` workers of `spec` via tfscale-launch; their outputs.

    Raises RuntimeError if the launch fails or a worker writes nothing.
    """
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
    command = [sys.executable, "-m", "launch.bench", f"--worker_spec={spec_path}"]
    print(f"tfscale-bench: launching {num_workers} worker(s): {name}", flush=True)
    code = local.launch(command, num_workers, timeout=FLAGS.timeout,
                        grace_seconds=FLAGS.grace_seconds, **emulation)
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


def context():
    """What every row records about the cluster."""
    n = FLAGS.num_workers
    rate = (bench_stats.parse_rate(FLAGS.inter_node_rate)
            if FLAGS.emulate_nodes and FLAGS.inter_node_rate else None)
    return {
        "num_workers": n,
        "local_size": FLAGS.local_size,
        "node_sizes": bench_stats.node_sizes(n, FLAGS.local_size, FLAGS.emulate_nodes),
        "emulate_nodes": FLAGS.emulate_nodes,
        "inter_node_rate": FLAGS.inter_node_rate if FLAGS.emulate_nodes else None,
        "link_rate": rate,
    }


def compressions():
    values = []
    for value in FLAGS.compression:
        if value not in ("none", "bfloat16", "float16"):
            raise app.UsageError(
                f"--compression values must be none, bfloat16 or float16; got {value!r}.")
        values.append(None if value == "none" else value)
    return values


def check_algorithms(allowed):
    for name in FLAGS.algorithms:
        if name not in allowed:
            raise app.UsageError(
                f"--algorithms: {name!r} is unknown; choose from {', '.join(allowed)}.")
    if not FLAGS.algorithms:
        raise app.UsageError("--algorithms is empty.")


def allreduce_command():
    check_algorithms(("stock", "ring", "hierarchical", "2d", "hybrid"))
    if FLAGS.num_workers < 2:
        raise app.UsageError("allreduce needs --num_workers >= 2.")
    if FLAGS.gradients:
        from launch import bench_allreduce

        input_sets = [(FLAGS.gradients, bench_allreduce.gradient_shapes(FLAGS.gradients))]
        mode = "gradients"
    else:
        try:
            sizes = bench_stats.parse_sizes(FLAGS.sizes)
        except ValueError as error:
            raise app.UsageError(f"--sizes: {error}") from None
        input_sets = [(bench_stats.human_bytes(s), [[s // 4]]) for s in sizes]
        mode = "sizes"
    cost_model = None
    if FLAGS.cost_model:
        with open(FLAGS.cost_model) as f:
            cost_model = json.load(f)
        cost_model = cost_model.get("cost_model", cost_model)
    spec = {
        "command": "allreduce", "input_sets": input_sets,
        "algorithms": FLAGS.algorithms, "compressions": compressions(),
        "repeats": FLAGS.repeats, "warmup": FLAGS.warmup,
        "local_size": FLAGS.local_size,
        "bytes_per_pack": FLAGS.bytes_per_pack if FLAGS.gradients else 0,
        "fusion_threshold_bytes": FLAGS.fusion_threshold_bytes,
        "collective_timeout": FLAGS.collective_timeout, "cost_model": cost_model,
    }
    sides = (["stock"] if "stock" in FLAGS.algorithms else []) + (
        ["tfscale"] if set(FLAGS.algorithms) - {"stock"} else [])
    ctx = dict(context(), mode=mode, model=FLAGS.gradients)
    rounds = []
    work_dir = tempfile.mkdtemp(prefix="tfscale-bench-")
    try:
        for round_index in range(FLAGS.rounds):
            outputs = []
            for side in sides:
                side_outputs = launch_workers(
                    dict(spec, side=side), work_dir, f"{side}-round{round_index}")
                bench_report.check_results(side_outputs)
                _check_topology(side_outputs, ctx)
                outputs.extend(side_outputs)
            rounds.append(_merge_sides(outputs))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    rows = bench_report.summarize(rounds, input_sets, ctx)
    print(bench_report.header(ctx, FLAGS.repeats, FLAGS.warmup, FLAGS.rounds))
    print(bench_report.table(rows), flush=True)
    if FLAGS.output:
        bench_report.write_json(rows, FLAGS.output)
        print(f"tfscale-bench: wrote {len(rows)} rows to {FLAGS.output}")
        if FLAGS.plot:
            from launch import bench_plot

            path = os.path.splitext(FLAGS.output)[0] + ".png"
            bench_plot.busbw_vs_size(rows, path, title=_plot_title(ctx))
            print(f"tfscale-bench: wrote {path}")
    return rows


def _check_topology(outputs, ctx):
    """tfscale's resolved nodes must be the ones the rows will report."""
    for output in outputs:
        if output.get("node_sizes") and output["node_sizes"] != ctx["node_sizes"]:
            raise RuntimeError(
                f"tfscale grouped the workers into nodes {output['node_sizes']}, "
                f"expected {ctx['node_sizes']}; pass --local_size to say how.")


def _merge_sides(outputs):
    """One output per rank holding the rows of every side."""
    merged = {}
    for output in outputs:
        entry = merged.setdefault(output["rank"], {"rank": output["rank"], "rows": []})
        entry["rows"].extend(output["rows"])
    return list(merged.values())


def _plot_title(ctx):
    nodes = ctx["node_sizes"]
    link = (f", inter-node {ctx['inter_node_rate']}" if ctx.get("inter_node_rate")
            else (", emulated nodes" if ctx.get("emulate_nodes") else ", loopback"))
    return f"all-reduce busbw, {ctx['num_workers']} workers in {len(nodes)} node(s){link}"


def run_worker(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["command"] == "allreduce":
        from launch import bench_allreduce as worker
    else:
        from launch import bench_train as worker
    worker.run_worker(spec)


def main(argv):
    if FLAGS.worker_spec:
        run_worker(FLAGS.worker_spec)
        return
    if len(argv) != 2 or argv[1] not in _COMMANDS:
        raise app.UsageError(
            f"Usage: tfscale-bench {{{'|'.join(_COMMANDS)}}} [--flags]; "
            f"received {' '.join(argv[1:]) or 'no command'}.")
    try:
        if argv[1] == "allreduce":
            allreduce_command()
        elif argv[1] == "project":
            from launch import bench_project

            bench_project.main(FLAGS)
        else:
            from launch import bench_train

            bench_train.main(FLAGS, launch_workers, context)
    except (RuntimeError, ValueError) as error:
        print(f"tfscale-bench: {error}", file=sys.stderr)
        sys.exit(1)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
