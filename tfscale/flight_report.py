"""The flight recorder's reports in words, and tfscale-launch's summary of
every worker's (see `tfscale.collectives.flight_recorder`).

Without TensorFlow: tfscale-launch reads the workers' `tfscale-flight` lines
and says which worker is behind, and it stays a small process.

Without tfscale-launch (Kubeflow, SLURM), the same summary from the
workers' saved logs: `python -m tfscale.flight_report worker-*.log`.
"""

import argparse
import json
import re
import sys

# The line tfscale-launch gathers from each worker's output.
LINE_PREFIX = "tfscale-flight "


def _what(record):
    """A gradient bucket, or what else the collective was for."""
    if record.get("purpose") == "gradients" and record.get("bucket") is not None:
        return f"gradient bucket {record['bucket']} of {record['buckets']}"
    return record.get("purpose") or record.get("op", "collective")


def _where(record):
    return (f"step {record['step']}" if record.get("step") is not None
            else "outside a training step")


def _sizes(record):
    """Its algorithm and "dtype x elements", those it has."""
    return [d for d in (record.get("algorithm"),
                        f"{record.get('dtype')} x {record.get('elements')}"
                        if record.get("dtype") else None) if d]


def describe(record):
    """One record in words: "step 7, gradient bucket 3 of 4 (ring; float32
    x 4754; variables a .. b), all_reduce on group 1 of 3 workers"."""
    details = _sizes(record) + (
        [f"variables {record['variables']}"] if record.get("variables") else [])
    group = (f", {record['op']} on group {record['group']} of "
             f"{record['group_size']} workers" if "group" in record else "")
    return (f"{_where(record)}, {_what(record)}"
            + (f" ({'; '.join(details)})" if details else "") + group)


# TensorFlow's collective parameter resolution, when two members of one
# collective instance bring tensors of different shapes.
_SHAPE_MISMATCH = re.compile(
    r"Shape mismatch in the collective instance (\d+)\.\s+Op at device "
    r"(\S+)\s+expected shape (\[[^\]]*\]) but another member in the group\s+"
    r"expected shape (\[[^\]]*\])", re.DOTALL)


def peer_mismatch(message):
    """What TensorFlow's error `message` says the members of a collective
    brought: "collective instance 113: worker 1 brought shape [4320], another
    worker [4754] ...", or None when it says nothing of the kind."""
    match = _SHAPE_MISMATCH.search(message or "")
    if not match:
        return None
    instance, device, one, other = match.groups()
    task = re.search(r"/task:(\d+)", device)
    who = f"worker {task.group(1)}" if task else device
    return (f"collective instance {instance}: {who} brought shape {one}, "
            f"another worker {other} (TensorFlow's error): the workers built "
            "different models, or different variables are trainable")


def parse(line):
    """The position a worker's `tfscale-flight` line holds, or None."""
    at = line.find(LINE_PREFIX)
    if at < 0:
        return None
    try:
        return json.loads(line[at + len(LINE_PREFIX):])
    except ValueError:
        return None


def _short(record):
    if record is None:
        return "no collective yet"
    return f"{_where(record)} ({_what(record)})"


def summarize(positions, num_workers, finished=()):
    """Names the worker(s) behind from every worker's position (`parse`):
    "workers 0, 2 wait in step 7 bucket 3 (ring, float32 x 4754); worker 1
    is at step 7 bucket 0 (last completed)" or "... sent no report".
    `finished`: indices of workers that exited successfully.
    """
    waiting = {}
    others = []
    for index in range(num_workers):
        position = positions.get(index)
        if position is None and index in finished:
            others.append(f"worker {index} finished (exit 0)")
        elif position is None:
            others.append(f"worker {index} sent no report (stopped, killed or hung "
                          "outside a collective)")
        elif position.get("pending"):
            pending = position["pending"]
            detail = ", ".join(_sizes(pending))
            key = _short(pending) + (f" ({detail})" if detail else "")
            waiting.setdefault(key, []).append(index)
        else:
            others.append(f"worker {index} is at {_short(position.get('completed'))} "
                          "(last completed, nothing pending)")
    parts = []
    for where, workers in waiting.items():
        who = (f"worker {workers[0]} waits" if len(workers) == 1 else
               f"workers {', '.join(map(str, workers))} wait")
        parts.append(f"{who} in {where}")
    return "; ".join(parts + others)


def read_logs(paths):
    """({worker: its last position}, [paths holding no report]) from
    workers' logs, in any order: a file may hold one worker's lines or
    several workers' interleaved (SLURM's single output); a later line, or
    a later file, replaces a worker's earlier report."""
    positions, silent = {}, []
    for path in paths:
        found = False
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                position = parse(line)
                if isinstance(position, dict) and isinstance(position.get("worker"), int):
                    positions[position["worker"]] = position
                    found = True
        if not found:
            silent.append(path)
    return positions, silent


def main(argv=None):
    """Prints the summary tfscale-launch prints, from saved worker logs.

    Returns:
        0 with a summary, 1 when no log holds a report, 2 for a log that
        cannot be read.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tfscale.flight_report",
        description="Names the worker(s) behind from the tfscale-flight lines "
        "of the workers' logs (kubectl logs POD > worker-1.log; SLURM "
        "--output=%t.log), as tfscale-launch does.")
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="a worker's log, or several workers' in one file")
    parser.add_argument("--num_workers", type=int, default=None,
                        help="workers in the job, to name those that left no "
                        "report (default: the largest index seen + 1, or more "
                        "when logs hold no report: one log per worker)")
    args = parser.parse_args(argv)
    try:
        positions, silent = read_logs(args.logs)
    except OSError as error:
        print(f"{parser.prog}: {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    if not positions:
        print(f"{parser.prog}: none of the {len(args.logs)} log(s) holds a "
              "tfscale-flight line (a worker prints one when it fails with "
              "collectives pending)", file=sys.stderr)
        return 1
    # One log per worker: a log without a report is a worker not seen (the
    # one behind, often). A report is never left out.
    num_workers = max(args.num_workers or len(positions) + len(silent),
                      max(positions) + 1)
    print(f"flight recorder: {summarize(positions, num_workers)}.")
    for path in silent:
        print(f"{path}: no tfscale-flight line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
