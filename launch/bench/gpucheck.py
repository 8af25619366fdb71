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

The check proves that the sums are right, not what the paths cost: after its
verdict on GPUs it prints the commands that measure them on the same GPUs
(`proving_commands`: every algorithm's all-reduce against stock and the
default, training throughput, op determinism's cost) and the BENCHMARKS.md
section their tables go to. `--commands` prints them for `--num_workers` GPUs
and exits, on any machine, starting no worker:

    tfscale-bench gpucheck --commands --num_workers=8
"""

import shutil
import tempfile

from absl import flags

from tfscale import communication_names
from tfscale.launch.bench import cluster
from tfscale.launch.bench import report
from tfscale.launch.bench import stats

FLAGS = flags.FLAGS
ALGORITHMS = communication_names.BUFFER_ALGORITHMS
# Where the tables of `proving_commands` go (a heading of BENCHMARKS.md).
BENCHMARKS_SECTION = "GPUs: the NCCL paths (not yet run)"


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
    flags.DEFINE_bool("commands", False, "Only print the commands that measure "
                      "the NCCL paths on --num_workers GPUs and record them in "
                      "BENCHMARKS.md, then exit; starts no worker, runs on any "
                      "machine.")


def main():
    """Checks every algorithm through NCCL and ring; prints the table (and,
    on GPUs, the commands to run next). With --commands only prints those."""
    if FLAGS.commands:
        return _print_commands()
    # --ring_only needs no GPU, so this process need not import TensorFlow.
    num_gpus = None if FLAGS.ring_only else gpus_here()
    if num_gpus == 0:
        raise RuntimeError(_no_gpu_message())
    num_workers = FLAGS.num_workers
    if not FLAGS.ring_only and not FLAGS["num_workers"].present:
        num_workers = num_gpus
    if num_workers < 2:
        seen = "" if num_gpus is None else f" (TensorFlow sees {num_gpus} GPU(s) here)"
        raise ValueError(f"gpucheck needs 2 or more workers (one per GPU); it would "
                         f"run {num_workers}{seen}.")
    gpus_per_node = None
    if not FLAGS.ring_only:
        if num_workers > num_gpus:
            raise ValueError(
                f"--num_workers={num_workers} but TensorFlow sees {num_gpus} "
                f"GPU(s) here: gpucheck runs one worker per GPU; give "
                f"--num_workers={num_gpus} or fewer.")
        gpus_per_node = num_workers
    size = stats.parse_sizes([FLAGS.size])[0]
    local_size = FLAGS.local_size or default_local_size(num_workers)
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
    if not FLAGS.ring_only:
        print(next_steps(num_workers, local_size, checked=True), flush=True)
    return rows


def _print_commands():
    """--commands: the next steps for --num_workers GPUs, before any check."""
    if FLAGS.num_workers < 2:
        raise ValueError(f"--commands needs --num_workers >= 2 (one per GPU). "
                         f"Received: --num_workers={FLAGS.num_workers}")
    local_size = FLAGS.local_size or default_local_size(FLAGS.num_workers)
    print(next_steps(FLAGS.num_workers, local_size, checked=False), flush=True)
    return proving_commands(FLAGS.num_workers, local_size)


def default_local_size(num_workers):
    """Half the workers with 4 or more (an even number), else None (one node).

    On one machine every worker is on one host, which tfscale makes one
    node: hierarchical and 2d would run as a ring. Two nodes of half the
    GPUs give them their sub-groups (several NCCL communicators per GPU).
    """
    if num_workers >= 4 and num_workers % 2 == 0:
        return num_workers // 2
    return None


def proving_commands(num_workers, local_size=None):
    """The commands that measure, on `num_workers` GPUs of one machine, what
    gpucheck only checks, each writing its rows under docs/bench/.

    gpucheck proves the sums over NCCL; nothing of tfscale has been timed on
    a GPU. These time tfscale's sub-group algorithms over NCCL (hierarchical,
    2d, halving_doubling, hybrid) against the default there (ring: one NCCL
    all-reduce per bucket) and stock, in the same run, on buffers from 4 KB
    to 256 MB and on ResNet-50's gradients (`bfloat16` too, which NCCL sends
    as float16 with a per-buffer scale); the same in training ResNet-50
    (32 images per GPU: the paper's 64K over 2048 GPUs) and AlexNet-BN (64),
    float32 and mixed_float16; and the cost of `tfscale-train
    --deterministic` on one GPU. Pure
    (no TensorFlow): gpucheck prints them on machines without GPUs too, and
    tests/test_gpucheck_commands.py parses each against its program's flags.

    Args:
        num_workers: GPUs, one worker each (`--gpus_per_node`).
        local_size: workers per node for tfscale's topology; None: one node.

    Returns:
        One shell command per string, to run from the checkout's root.
    """
    tag = f"gpu{num_workers}"
    workers = [("num_workers", num_workers), ("gpus_per_node", num_workers)]
    if local_size:
        workers.append(("local_size", local_size))
    every = ",".join(("stock", *communication_names.FIXED_ALGORITHMS))
    allreduce = [*workers, ("algorithms", every), ("compression", "none,bfloat16"),
                 ("rounds", 2)]
    train = [*workers, ("image_size", 224), ("steps", 20), ("warmup_steps", 5),
             ("precisions", "float32,mixed_float16"),
             ("algorithms", "stock,ring,hierarchical,hybrid")]
    return [
        _command("tfscale-bench allreduce", [
            *allreduce, ("sizes", "4KB,64KB,1MB,16MB,256MB"), ("warmup", 5),
            ("repeats", 20), ("output", f"docs/bench/allreduce_sizes_{tag}.json"),
            ("plot", True)]),
        _command("tfscale-bench allreduce", [
            *allreduce, ("gradients", "resnet50"), ("warmup", 3), ("repeats", 10),
            ("output", f"docs/bench/allreduce_resnet50_{tag}.json"), ("plot", True)]),
        *(_command("tfscale-bench train", [
            ("model", model), *train, ("per_worker_batch", batch),
            ("output", f"docs/bench/train_{model}_{tag}.json"), ("plot", True)])
          for model, batch in (("resnet50", 32), ("alexnet_bn", 64))),
        # One process on one GPU: op determinism's cost, not communication.
        _command("CUDA_VISIBLE_DEVICES=0 python -m tfscale.launch.studies.precision_speed", [
            ("model", "resnet50"), ("image_size", 224), ("batch_size", 32),
            ("steps", 20), ("warmup_steps", 5), ("precisions", "float32,mixed_float16"),
            ("deterministic_too", True), ("rounds", 2)]),
    ]


def _command(program, flag_values):
    """`program --name=value ...`; True is a boolean flag given alone."""
    return " ".join([program] + [f"--{name}" if value is True else f"--{name}={value}"
                                 for name, value in flag_values])


def next_steps(num_workers, local_size, checked):
    """What to run after the check, and where the results go.

    Args:
        checked: True after a check on these GPUs; False for --commands.
    """
    if checked:
        lines = [f"Next: to prove the other paths on these {num_workers} GPUs "
                 "and record them in BENCHMARKS.md, run:"]
    else:
        lines = [f"To prove the other paths on {num_workers} GPUs and record "
                 "them in BENCHMARKS.md, run on that machine, from the "
                 f"checkout's root, after `tfscale-bench gpucheck "
                 f"--num_workers={num_workers}` has passed:"]
    lines += proving_commands(num_workers, local_size)
    lines.append(f"Then copy each command and the table it prints into "
                 f"BENCHMARKS.md, section \"{BENCHMARKS_SECTION}\"; the JSON "
                 "(and PNG) files stay in docs/bench/.")
    if not local_size:
        lines.append(f"On {num_workers} GPUs the workers form one node, so "
                     "hierarchical and 2d run as ring: 4 or more GPUs (an even "
                     "number) or --local_size give them sub-groups.")
    return "\n".join(lines)


def gpus_here():
    """How many GPUs TensorFlow sees; imports TensorFlow, so only a check
    calls it (--commands does not)."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def _no_gpu_message():
    import tensorflow as tf

    build = "built with CUDA" if tf.test.is_built_with_cuda() else "built without CUDA"
    return (f"TensorFlow sees no GPU on this machine (tensorflow {tf.__version__}, "
            f"{build}), so there is no NCCL to check: run it on a GPU machine "
            "with pip install 'tensorflow[and-cuda]'; --ring_only checks only "
            "the ring half here; --commands --num_workers=N prints what to run "
            "on N GPUs after the check.")


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
