r"""tfscale-bench: all-reduce and training benchmarks, and a cost-model projection.

    tfscale-bench allreduce --num_workers=4 --local_size=2 \
        --sizes=64KB,1MB,16MB --algorithms=stock,ring,hierarchical,2d,hybrid \
        --repeats=5 --output=docs/bench/allreduce.json --plot
    tfscale-bench allreduce --num_workers=4 --emulate_nodes=2 \
        --inter_node_rate=200mbit --gradients=resnet50 --compression=none,bfloat16
    tfscale-bench project --measurements=docs/bench/allreduce.json
    tfscale-bench train --model=resnet50 --num_workers=4 --image_size=64 --steps=5
    tfscale-bench gpucheck
    tfscale-bench scale --worker_counts=16 --num_workers=16 --emulate_nodes=4
    tfscale-bench fixedcost --worker_counts=2,4,8

One module per subcommand (`allreduce`, `train`, `project`, `gpucheck`, `scale`,
`fixedcost`), each defining its
own flags when it is chosen: `tfscale-bench allreduce --help` lists what
`allreduce` takes. All but `project` start their workers through
tfscale-launch (`cluster.launch_workers`); each worker process runs
`python -m tfscale.launch.bench.worker SPEC`.
"""

import importlib
import sys

from absl import app

from tfscale.launch import flag_help
from tfscale.launch import garbage_collection

# Subcommand -> what it does, for the usage line.
SUBCOMMANDS = {
    "allreduce": "all-reduce time, algbw and busbw per size and algorithm",
    "train": "training throughput, scaling efficiency, exposed communication",
    "project": "fit the alpha-beta cost model; project to the paper's hardware",
    "gpucheck": "run first on GPUs: each algorithm via NCCL and ring, sums checked",
    "scale": "start-up and memory per worker count; every algorithm trains as one worker",
    "fixedcost": "what one 4-byte all-reduce costs: bare TF ops, stock, each algorithm",
}


def usage():
    """The usage text naming every subcommand."""
    lines = [f"Usage: tfscale-bench {{{'|'.join(SUBCOMMANDS)}}} [--flags]"]
    lines += [f"  {name:<10} {summary}" for name, summary in SUBCOMMANDS.items()]
    lines.append("`tfscale-bench SUBCOMMAND --help` lists that subcommand's flags.")
    return "\n".join(lines)


def _subcommand(argv):
    """The first argument that is not a flag, or None."""
    for arg in argv[1:]:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def _list_in_help(command):
    """Makes `--help` describe `command` and list the flags launch/ defined
    (the subcommand's own, and tfscale-launch's from launch.local)."""
    sys.modules["__main__"].__doc__ = command.__doc__
    flag_help.list_in_help("tfscale.launch.")


def run(argv=None):
    """The `tfscale-bench` console script: picks the subcommand and runs it.

    Args:
        argv: the command line; None: sys.argv.
    """
    argv = list(sys.argv if argv is None else argv)
    name = _subcommand(argv)
    if name is None:
        wants_help = any(a in ("--help", "-h", "-?", "--helpshort") for a in argv[1:])
        print(usage(), file=sys.stdout if wants_help else sys.stderr)
        sys.exit(0 if wants_help else 2)
    if name not in SUBCOMMANDS:
        print(f"tfscale-bench: unknown subcommand {name!r}.\n{usage()}", file=sys.stderr)
        sys.exit(2)
    command = importlib.import_module(f"tfscale.launch.bench.{name}")
    command.define_flags()
    _list_in_help(command)
    garbage_collection.skip_final_collection()
    app.run(lambda args: _main(command, name, args), argv=argv)


def _main(command, name, argv):
    """Runs the subcommand; its expected failures end in one line, exit 1."""
    extra = argv[1:]
    extra.remove(name)
    if extra:
        sys.exit(f"tfscale-bench {name} takes flags only. Received: "
                 f"{' '.join(extra)}")
    try:
        command.main()
    except (RuntimeError, ValueError) as error:
        print(f"tfscale-bench {name}: {error}", file=sys.stderr)
        sys.exit(1)
