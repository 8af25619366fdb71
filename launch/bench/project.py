"""tfscale-bench project: the alpha-beta cost model, fit here and projected.

(a) Fit: `tfscale.collectives.cost_model.fit` on the single-buffer rows of a
JSON that `tfscale-bench allreduce` wrote (tfscale's ring, hierarchical, 2d and
halving_doubling rows without compression, each with its chunk count), then predicted vs
measured side by side. The fitted model can be written as JSON and handed back
to `tfscale-bench allreduce --cost_model=...` (chunk counts, hybrid threshold).

(b) Projection to the paper's hardware. Every number below is either taken
from a source named beside it or marked as an assumption; nothing here is a
measurement of that hardware. The all-reduce of one training step is planned
by tfscale's own `collectives.plan` (fusion in backward order, the hybrid
threshold and chunk counts from the cost model) over the model's real
gradient shapes, and each bucket's time predicted by the cost model, which
counts each collective op's fixed cost (NCCL's small-message all-reduce
time, cited; what BENCHMARKS.md's section "The fixed cost of one
collective" measures for TensorFlow's op
on CPU can be put in its place with --op_seconds). Compute
and communication are assumed not to overlap (a conservative bound on the
step time), so scaling efficiency e = t_compute / (t_compute + t_allreduce).

PowerSGD at rank r (`--powersgd_rank`) is predicted as tfscale runs it: the
tensors it leaves uncompressed fused and all-reduced by hybrid, then one
buffer of every P, then one of every Q (`tfscale.collectives.powersgd.plan`
decides which gradients are compressed), one after the other. The time to
compute the factors (matrix products and Gram-Schmidt on the GPU) is not in
the model: optimistic.
"""

import dataclasses
import json
import math

from absl import flags

from tfscale.communication_names import BUFFER_ALGORITHMS
from tfscale.launch.bench import cluster
from tfscale.launch.bench import gradients
from tfscale.launch.bench import stats

# The paper: Jia et al. 2018, "Highly Scalable Deep Learning Training System
# with Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
PAPER = "Jia et al. 2018 (arXiv:1807.11205)"
ABSTRACT = f"{PAPER}, abstract (https://arxiv.org/abs/1807.11205)"
DESIGN = "tfscale's design notes (the project's summary of the paper)"
# Where the benchmark's brief, not a page of the paper read here, is the source.
SPECIFIED = ("the paper's cluster as tfscale's benchmark specification states it; "
             "not checked against the paper's text here")
IMAGENET_TRAIN_IMAGES = 1_281_167  # ILSVRC2012 train split (tfds imagenet2012)
FLAGS = flags.FLAGS
# The algorithms the alpha-beta model predicts (hybrid picks among them).
_MODELLED = BUFFER_ALGORITHMS
# The projection's columns: t_<key> and e_<key> of each row.
_PROJECTED = ("ring", "hierarchical", "halving_doubling", "hybrid", "hybrid_16bit",
              "powersgd")


def define_flags():
    """Defines project's flags."""
    flags.DEFINE_string("measurements", None,
                        "JSON rows of `allreduce --sizes=...` to fit the cost model on; "
                        "unset: only the projection.")
    flags.DEFINE_string("fitted_output", None, "Write the fitted cost model here "
                        "(JSON, for allreduce --cost_model).")
    flags.DEFINE_string("output", None, "Write the fit and the projection as JSON here.")
    flags.DEFINE_list("gpus", ["8", "16", "32", "64", "128", "256", "512", "1024", "2048"],
                      "GPU counts to project to.")
    flags.DEFINE_integer("powersgd_rank", 4, "Rank of the PowerSGD columns.",
                         lower_bound=1)
    flags.DEFINE_float("alpha_scale", 1.0, "Multiply the paper hardware's "
                       "latencies by this (sensitivity check).", lower_bound=0)
    flags.DEFINE_float("op_seconds", None, "The fixed cost of one collective op "
                       "on the paper's hardware; unset: the cited NCCL figure "
                       "(60 us; see the assumption). 1e-3: about TensorFlow's op on "
                       "CPU workers, as tfscale-bench fixedcost measures it "
                       "(sensitivity check).", lower_bound=0)


@dataclasses.dataclass(frozen=True)
class Assumption:
    name: str
    value: object
    source: str


def paper_assumptions():
    """The paper's hardware, each value with where it comes from."""
    pcie3_x16 = 8e9 * 16 * 128 / 130 / 8  # bytes/s per direction
    return [
        Assumption("GPUs per node", 8,
                   f"{PAPER}: P40 GPUs, 8 per node ({SPECIFIED}; {DESIGN})"),
        Assumption("inter-node bandwidth (bytes/s per direction)", 100e9 / 8,
                   f"100 Gb/s Ethernet with RDMA ({SPECIFIED}); 100e9 bits/s / 8"),
        Assumption("intra-node bandwidth (bytes/s per direction)", pcie3_x16,
                   "P40s have no NVLink; their interface is PCIe 3.0 x16 (NVIDIA "
                   "P40 specifications, e.g. sysrqmts.com/gpus/nvidia/tesla/p40): "
                   "8 GT/s x 16 lanes x 128/130 encoding / 8 = 15.75 GB/s. GPUs "
                   "sharing a PCIe switch share it: not modelled (optimistic)"),
        Assumption("inter-node latency alpha (s)", 0.8e-6,
                   "NOT FOUND for the paper's cluster. Stand-in: one-way RDMA "
                   "latency of a 32-byte message, ib_send_lat, 0.8 us (table in "
                   "git.dennispotter.eu/Dennis/masters-thesis, tables/"
                   "mtu_performance.tex). Software overhead per collective op "
                   "(NCCL, kernel launches) is the next assumption"),
        Assumption("intra-node latency alpha (s)", 0.8e-6,
                   "NOT FOUND; assumed equal to the inter-node stand-in"),
        Assumption("fixed cost of one collective op (s)", 60e-6,
                   "what one NCCL all-reduce of a few bytes takes, launch and "
                   "synchronisation included: 54.2 us for 8 bytes on 8 PCIe GPUs "
                   "without NVLink in one node (nccl-tests all_reduce_perf, "
                   "github.com/NVIDIA/nccl/issues/1439), 61.6 us for 128 bytes "
                   "across InfiniBand H100 nodes (github.com/NVIDIA/nccl/issues/"
                   "1453); rounded to 60 us. TensorFlow's op on CPU workers over "
                   "gRPC costs a millisecond or more (tfscale-bench fixedcost; "
                   "BENCHMARKS.md, section \"The fixed cost of one collective\"): "
                   "--op_seconds=1e-3 projects with that instead"),
        Assumption("single-GPU ResNet-50 throughput (images/s)", 218,
                   f"{PAPER}, mixed precision on one P40 (172 in FP32): "
                   f"'172 -> 218 img/s' in {DESIGN}"),
        Assumption("ResNet-50 per-GPU batch", 32,
                   f"64K global batch on 2048 GPUs ({DESIGN}; batch up to 64k: "
                   f"{ABSTRACT})"),
        Assumption("single-GPU AlexNet throughput (images/s)", None,
                   "NOT FOUND in the sources available here: AlexNet's scaling "
                   "efficiency is not projected, only its all-reduce time"),
        Assumption("fusion threshold (bytes)", 32 * 1024 * 1024,
                   "the paper's threshold was not found; tfscale's default"),
        Assumption("wire dtype", "float32",
                   "whether the paper all-reduces FP16 or FP32 gradients was not "
                   "confirmed here; FP32 (tfscale's default), 16-bit shown too"),
        Assumption("compute/communication overlap", "none",
                   "not modelled: t_step = t_compute + t_allreduce (pessimistic)"),
    ]


def _paper_rate_ratio():
    """ResNet-50: the paper's images/s per GPU on 2048 over one GPU's 218."""
    return 90 * IMAGENET_TRAIN_IMAGES / (6.6 * 60) / 2048 / 218


def paper_reported():
    """The paper's figures printed beside the projection, with their source.

    Derived values say how they were derived from reported ones.
    """
    resnet_rate = _paper_rate_ratio() * 2048 * 218
    alexnet_rate = 95 * IMAGENET_TRAIN_IMAGES / (4 * 60)
    return {
        "resnet50": [
            f"75.8% top-1 in 6.6 min on 2048 P40 ({ABSTRACT}; 90 epochs per the "
            "abstract's framing)",
            f"derived: 90 x {IMAGENET_TRAIN_IMAGES:,} images / 396 s = "
            f"{resnet_rate:,.0f} images/s = {resnet_rate / 2048:.0f} per GPU, "
            f"{resnet_rate / 2048 / 218:.2f} of the single-GPU 218 images/s "
            "(an end-to-end average: includes everything in those minutes)",
            f"all-reduce up to 11x faster than NCCL-based training at 1024 GPUs ({ABSTRACT})",
            "the paper's own scaling-efficiency figure: NOT FOUND in the sources available here",
        ],
        "alexnet_bn": [
            f"58.7% top-1 within 4 min, 95 epochs ({ABSTRACT}); on 1024 P40 ({DESIGN})",
            f"derived: 95 x {IMAGENET_TRAIN_IMAGES:,} images / 240 s = "
            f"{alexnet_rate:,.0f} images/s = {alexnet_rate / 1024:.0f} per GPU on 1024",
            f"all-reduce up to 3x faster than NCCL-based training at 1024 GPUs ({ABSTRACT})",
        ],
    }


def fit_rows(rows):
    """The measurements `cost_model.fit` takes, and their topology.

    Uses tfscale's single-buffer rows without compression whose algorithm is
    one the model describes (ring, hierarchical, 2d, halving_doubling).

    Returns:
        `(measurements, node_sizes, used_rows)`.
    """
    used = [r for r in rows
            if r.get("mode") == "sizes" and r.get("side") == "tfscale"
            and r.get("compression") is None
            and r.get("algorithm") in _MODELLED]
    if not used:
        raise ValueError(
            f"No rows to fit: the measurements need tfscale {'/'.join(_MODELLED)} "
            "rows of `tfscale-bench allreduce --sizes=...` without compression.")
    topologies = {tuple(r["node_sizes"]) for r in used}
    if len(topologies) != 1:
        raise ValueError(f"The rows come from several topologies: {sorted(topologies)}.")
    measurements = [(r["algorithm"], r["wire_bytes"], r["seconds"], r.get("num_chunks", 1))
                    for r in used]
    return measurements, list(topologies.pop()), used


def fit_table(model, rows, node_sizes):
    """Measured vs predicted for the fitted rows (and stock, predicted as a
    ring, shown but not fitted)."""
    lines = []
    for r in rows:
        algorithm = "ring" if r["side"] == cluster.STOCK else r["algorithm"]
        if algorithm not in _MODELLED or r.get("compression"):
            continue
        chunks = r.get("num_chunks", 1)
        predicted = model.predict(algorithm, r["wire_bytes"], node_sizes, chunks)
        lines.append([r["bytes"], r["label"] + ("" if r["side"] == "tfscale" else " (not fitted)"),
                      chunks, r["seconds"] * 1e3, predicted * 1e3, predicted / r["seconds"]])
    return stats.format_table(
        ["size (B)", "algorithm", "chunks", "measured (ms)", "predicted (ms)", "pred/meas"],
        lines, [">", "<", ">", ">", ">", ">"])


def describe_model(model):
    return (f"op {model.op_seconds * 1e6:.1f} us; "
            f"intra: alpha {model.intra.alpha * 1e6:.1f} us, "
            f"{1 / model.intra.beta / 1e6 if model.intra.beta else math.inf:.1f} MB/s; "
            f"inter: alpha {model.inter.alpha * 1e6:.1f} us, "
            f"{1 / model.inter.beta / 1e6 if model.inter.beta else math.inf:.1f} MB/s")


def step_allreduce_seconds(shapes, model, node_sizes, algorithm, fusion_bytes, wire_bytes_per_value=4):
    """Predicted seconds to all-reduce a gradient list as tfscale plans it."""
    import tensorflow as tf

    from tfscale import collectives
    from tfscale.collectives import topology as topology_lib

    nodes, start = [], 0
    for size in node_sizes:
        nodes.append(tuple(range(start, start + size)))
        start += size
    topology = topology_lib.Topology(nodes=tuple(nodes), rank=0)
    backward = list(reversed(shapes))
    sizes = [4 * math.prod(s) for s in backward]
    compression = None if wire_bytes_per_value == 4 else "float16"
    buckets = collectives.plan(sizes, [tf.float32] * len(sizes), topology, algorithm,
                               fusion_bytes, compression=compression, cost_model=model)
    return sum(model.predict(b.algorithm, b.wire_bytes, node_sizes, b.num_chunks)
               for b in buckets)


def powersgd_allreduce_seconds(shapes, model, node_sizes, fusion_bytes, rank):
    """Predicted seconds of PowerSGD's three all-reduces (the uncompressed
    tensors, all Ps, all Qs), each by hybrid, without computing the factors."""
    from tfscale.collectives import powersgd

    matrices = powersgd.plan(shapes, ["float32"] * len(shapes), rank)
    compressed = {m.index for m in matrices}
    rest = [s for i, s in enumerate(shapes) if i not in compressed]
    p_values = sum(m.rows * m.rank for m in matrices)
    q_values = sum(m.cols * m.rank for m in matrices)
    return sum(step_allreduce_seconds(group, model, node_sizes, "hybrid", fusion_bytes)
               for group in (rest, [[p_values]], [[q_values]]) if group)


def project(model, gradient_shapes, gpu_counts, assumptions, powersgd_rank=4):
    """Projected rows for each model name in `gradient_shapes` and GPU count."""
    values = {a.name: a.value for a in assumptions}
    per_node = values["GPUs per node"]
    fusion = values["fusion threshold (bytes)"]
    compute = {"resnet50": values["ResNet-50 per-GPU batch"]
               / values["single-GPU ResNet-50 throughput (images/s)"]}
    rows = []
    for name, shapes in gradient_shapes.items():
        for gpus in gpu_counts:
            node_sizes = [per_node] * (gpus // per_node) if gpus >= per_node else [gpus]
            row = {"model": name, "gpus": gpus, "nodes": len(node_sizes),
                   "params": sum(math.prod(s) for s in shapes),
                   "t_compute": compute.get(name)}
            for algorithm in ("ring", "hierarchical", "halving_doubling", "hybrid"):
                row[f"t_{algorithm}"] = step_allreduce_seconds(
                    shapes, model, node_sizes, algorithm, fusion)
            # One ring all-reduce per tensor, no fusion.
            row["t_ring_unfused"] = step_allreduce_seconds(
                shapes, model, node_sizes, "ring", 0)
            row["t_hybrid_16bit"] = step_allreduce_seconds(
                shapes, model, node_sizes, "hybrid", fusion, wire_bytes_per_value=2)
            row["powersgd_rank"] = powersgd_rank
            row["t_powersgd"] = powersgd_allreduce_seconds(
                shapes, model, node_sizes, fusion, powersgd_rank)
            for key in _PROJECTED:
                t_c = row["t_compute"]
                row[f"e_{key}"] = t_c / (t_c + row[f"t_{key}"]) if t_c else None
            rows.append(row)
    return rows


def projection_table(rows):
    rank = rows[0]["powersgd_rank"]
    lines = []
    for r in rows:
        lines.append([r["gpus"], r["nodes"], r["t_ring_unfused"] * 1e3,
                      *(r[f"t_{key}"] * 1e3 for key in _PROJECTED),
                      r["t_ring_unfused"] / r["t_hybrid"],
                      *(r[f"e_{key}"] for key in _PROJECTED)])
    names = ["ring", "hier.", "h-d", "hybrid", "hybrid 16b", f"PowerSGD r{rank}"]
    return stats.format_table(
        ["GPUs", "nodes", "ring unfused (ms)", *(f"{n} (ms)" for n in names),
         "unfused/hybrid", *(f"e {n}" for n in names)], lines)


def main():
    """Runs project with its flags; prints the fit and the projection, writes JSON."""
    result = {}
    if FLAGS.measurements:
        result["fit"] = _fit_measurements(FLAGS.measurements)
        if FLAGS.fitted_output:
            stats.write_json(result["fit"], FLAGS.fitted_output)
            print(f"tfscale-bench: wrote the fitted model to {FLAGS.fitted_output}")
    result.update(_project_paper_hardware(_gpu_counts(FLAGS.gpus), FLAGS.alpha_scale,
                                          FLAGS.op_seconds))
    if FLAGS.output:
        stats.write_json(result, FLAGS.output)
        print(f"tfscale-bench: wrote {FLAGS.output}")
    return result


def _gpu_counts(values):
    """--gpus as positive integers."""
    counts = []
    for value in values:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--gpus takes positive integers. Received: --gpus={value}")
        counts.append(int(value))
    return counts


def _fit_measurements(path):
    """(a): fits the cost model on the rows at `path`; prints it against them."""
    from tfscale.collectives import cost_model as cost_model_lib

    with open(path) as f:
        rows = json.load(f)
    measurements, node_sizes, used = fit_rows(rows)
    fitted = cost_model_lib.fit(measurements, node_sizes)
    print(f"# (a) alpha-beta model fit with tfscale.collectives.cost_model.fit on "
          f"{len(measurements)} rows of {path} "
          f"(nodes {node_sizes}, {used[0].get('inter_node_rate') or 'no rate limit'})")
    print(f"# fitted: {describe_model(fitted)}")
    rate = used[0].get("link_rate")
    if rate:
        print(f"# the emulated inter-node link's configured rate: {rate / 1e6:.1f} MB/s")
    print(fit_table(fitted, rows, node_sizes))
    return {"cost_model": fitted.get_config(), "node_sizes": node_sizes,
            "measurements": path}


def _project_paper_hardware(gpu_counts, alpha_scale, op_seconds=None):
    """(b): projects both models to the paper's hardware; prints each table
    beside what the paper reports."""
    from tfscale.collectives import cost_model as cost_model_lib

    assumptions = paper_assumptions()
    values = {a.name: a.value for a in assumptions}
    paper_model = cost_model_lib.CostModel(
        intra=cost_model_lib.Link(values["intra-node latency alpha (s)"] * alpha_scale,
                                  1 / values["intra-node bandwidth (bytes/s per direction)"]),
        inter=cost_model_lib.Link(values["inter-node latency alpha (s)"] * alpha_scale,
                                  1 / values["inter-node bandwidth (bytes/s per direction)"]),
        op_seconds=(values["fixed cost of one collective op (s)"] if op_seconds is None
                    else op_seconds))
    print("\n# (b) projection to the paper's hardware. Assumptions and their sources:")
    for a in assumptions:
        print(f"#   {a.name} = {a.value}: {a.source}")
    if alpha_scale != 1:
        print(f"#   both alphas multiplied by --alpha_scale={alpha_scale:g} (sensitivity check)")
    if op_seconds is not None:
        print(f"#   fixed cost of one collective op set by --op_seconds={op_seconds:g} "
              "(sensitivity check)")
    print(f"# cost model: {describe_model(paper_model)}")
    shapes = {name: gradients.shapes(name) for name in ("resnet50", "alexnet_bn")}
    rows = project(paper_model, shapes, gpu_counts, assumptions, FLAGS.powersgd_rank)
    reported = paper_reported()
    for name in shapes:
        model_rows = [r for r in rows if r["model"] == name]
        print(f"\n## {name}: {model_rows[0]['params']:,} float32 gradients "
              f"({4 * model_rows[0]['params'] / 1e6:.1f} MB), "
              f"{len(shapes[name])} tensors; all-reduce time per step, scaling "
              "efficiency e = t_compute / (t_compute + t_allreduce); ring unfused = one "
              "ring all-reduce per tensor; the others fuse into 32 MiB buffers; h-d = "
              f"halving-doubling; PowerSGD r{FLAGS.powersgd_rank} = its uncompressed "
              "tensors, Ps and Qs by hybrid (computing the factors not counted)"
              + ("" if model_rows[0]["t_compute"] else " (not computed: no single-GPU throughput)"))
        if model_rows[0]["t_compute"]:
            print(f"# t_compute = {model_rows[0]['t_compute'] * 1e3:.1f} ms per step per GPU")
        print(projection_table(model_rows))
        print("# the paper reports:")
        for line in reported[name]:
            print(f"#   {line}")
        last = model_rows[-1]
        if last["t_compute"]:
            print(f"# at {last['gpus']} GPUs the projection's e is {last['e_hybrid']:.2f} "
                  f"(hybrid, float32 on the wire) and {last['e_hybrid_16bit']:.2f} "
                  "(16-bit), all-reduce not overlapped; the paper's end-to-end "
                  "rate per GPU over the single-GPU rate is "
                  f"{_paper_rate_ratio():.2f} (it also counts input, evaluation "
                  "and start-up)")
    return {"projection": rows,
            "assumptions": [dataclasses.asdict(a) for a in assumptions],
            "alpha_scale": alpha_scale, "op_seconds": paper_model.op_seconds,
            "paper_reported": reported}
