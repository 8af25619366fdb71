"""tfscale-bench allreduce: all-reduce time, algbw and busbw, as nccl-tests does.

It starts --num_workers workers itself (through tfscale-launch, so
--emulate_nodes/--inter_node_rate place them in emulated nodes); each
all-reduces integer-valued float32 buffers with every algorithm, checks each
result against the exact sum, then times --repeats calls
(allreduce_worker.py). The table gives the median, algbw and busbw. "stock"
is TF's own MultiWorkerMirroredStrategy all-reduce, reducing the way Keras
does; it runs in its own launch, the tfscale algorithms in another, and
--rounds alternates them. --gradients all-reduces a model's real gradient
list instead of single buffers.
"""

import os
import shutil
import tempfile

from absl import flags

from tfscale.launch.bench import cluster
from tfscale.launch.bench import report
from tfscale.launch.bench import stats

_MiB = 1024 * 1024
FLAGS = flags.FLAGS


def define_flags():
    """Defines allreduce's flags (and the cluster flags it shares with train)."""
    cluster.define_flags()
    flags.DEFINE_list("sizes", ["64KB", "1MB", "4MB", "16MB"],
                      "Buffer sizes (B, KB, MB, GB: powers of 1024).")
    flags.DEFINE_integer("repeats", 5, "Timed calls per case.", lower_bound=1)
    flags.DEFINE_integer("warmup", 2, "Untimed calls per case before the result "
                         "check.", lower_bound=1)
    flags.DEFINE_integer("rounds", 1, "Launches per side (stock, tfscale), "
                         "alternating; repeats of all rounds are pooled.",
                         lower_bound=1)
    flags.DEFINE_enum("gradients", None, ["resnet50", "alexnet_bn"],
                      "All-reduce this model's trainable-variable shapes "
                      "(float32, forward order) instead of --sizes.")
    flags.DEFINE_integer("bytes_per_pack", 32 * _MiB,
                         "With --gradients: stock also runs with "
                         "CommunicationOptions(bytes_per_pack=this); 0: not.",
                         lower_bound=0)
    flags.DEFINE_string("cost_model", None,
                        "JSON of a fitted CostModel (as `project` writes) for "
                        "tfscale's chunk counts and hybrid threshold; unset: the default.")
    flags.DEFINE_string("output", None, "Write the rows as JSON here.")
    flags.DEFINE_bool("plot", False, "With --output: also write a PNG of busbw "
                      "vs size next to it.")


def _input_sets():
    """`(mode, [(name, shapes)])`: what each case all-reduces."""
    if FLAGS.gradients:
        from tfscale.launch.bench import gradients

        return "gradients", [(FLAGS.gradients, gradients.shapes(FLAGS.gradients))]
    try:
        sizes = stats.parse_sizes(FLAGS.sizes)
    except ValueError as error:
        raise ValueError(f"--sizes: {error}") from None
    return "sizes", [(stats.human_bytes(s), [[s // 4]]) for s in sizes]


def _cost_model():
    """The fitted cost model's config from --cost_model, or None."""
    if not FLAGS.cost_model:
        return None
    # Imports TensorFlow (the collectives package): only when asked for.
    from tfscale.collectives import cost_model as cost_model_lib

    return cost_model_lib.load(FLAGS.cost_model).get_config()


def main():
    """Runs allreduce with its flags; prints the table, writes JSON (and PNG)."""
    if FLAGS.num_workers < 2:
        raise ValueError(f"allreduce needs --num_workers >= 2. "
                         f"Received: --num_workers={FLAGS.num_workers}")
    configs = cluster.configs()
    mode, input_sets = _input_sets()
    spec = {
        "command": "allreduce", "input_sets": input_sets,
        "repeats": FLAGS.repeats, "warmup": FLAGS.warmup,
        "local_size": FLAGS.local_size,
        "bytes_per_pack": FLAGS.bytes_per_pack if FLAGS.gradients else 0,
        "fusion_threshold_bytes": FLAGS.fusion_threshold_bytes,
        "collective_timeout": FLAGS.collective_timeout, "cost_model": _cost_model(),
    }
    # One launch per side: stock alone, every tfscale configuration together.
    sides = {}
    for name, algorithm, compression in configs:
        side = cluster.STOCK if algorithm == cluster.STOCK else "tfscale"
        # "auto": NCCL on GPUs, ring elsewhere (tfscale's default).
        sides.setdefault(side, []).append([name, algorithm, compression, "auto"])
    ctx = dict(cluster.context(), mode=mode, model=FLAGS.gradients)
    rounds = []
    work_dir = tempfile.mkdtemp(prefix="tfscale-bench-")
    try:
        for round_index in range(FLAGS.rounds):
            outputs = []
            for side, side_configs in sides.items():
                side_outputs = cluster.launch_workers(
                    dict(spec, side=side, configs=side_configs), work_dir,
                    f"{side}-round{round_index}")
                report.check_results(side_outputs)
                _check_topology(side_outputs, ctx)
                outputs.extend(side_outputs)
            rounds.append(_merge_sides(outputs))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    rows = report.summarize(rounds, input_sets, ctx)
    print(report.header(ctx, FLAGS.repeats, FLAGS.warmup, FLAGS.rounds))
    print(report.table(rows), flush=True)
    if FLAGS.output:
        report.write_json(rows, FLAGS.output)
        print(f"tfscale-bench: wrote {len(rows)} rows to {FLAGS.output}")
        if FLAGS.plot:
            from tfscale.launch.bench import plot

            path = os.path.splitext(FLAGS.output)[0] + ".png"
            plot.busbw_vs_size(rows, path, title=(
                f"all-reduce busbw\n{stats.describe_cluster(ctx)}"))
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
