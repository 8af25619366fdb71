"""The timeline: where each worker's step time goes, in Chrome's trace format.

`CommunicationOptions(timeline=DIR)` (`tfscale-train --timeline=DIR`) makes
every worker stamp, in its training graph, each span of its steps (the step,
forward+backward, each gradient bucket and its stages: fuse, compress, the
algorithm, decompress, unpack; the optimizer update) and each collective
(`tfscale.collectives.timeline_stamps`, the flight recorder's completion
stamps), and write its last steps to `DIR/worker-I.json` at exit. Each file
opens alone in Perfetto (ui.perfetto.dev) or chrome://tracing;

    python -m tfscale.timeline merge DIR

joins them into `DIR/timeline.json`, one process per worker, shifted by
each worker's clock offset from the chief as measured when its strategy
started (none on the chief's host, which shares its clock), and

    python -m tfscale.timeline plot DIR/timeline.json --step 5 -o step.png

draws one step of every worker;

    python -m tfscale.timeline summary DIR/timeline.json

prints the medians of the step, of the communication left after
forward+backward, and of the spread of the buckets' starts. The format: the Trace Event Format
(Google, "Trace Event Format", 2016: complete events `"ph": "X"`, times in
microseconds); lanes as in Horovod's timeline (one row per tensor there, per
bucket here). This module needs no TensorFlow.
"""

import argparse
import glob
import json
import os
import sys

from tfscale import _atomic
from tfscale import _requirements

FILE_PATTERN = "worker-*.json"
MERGED = "timeline.json"
# Lanes of a worker, top to bottom (buckets and their collectives between).
_FIRST_LANES = ("step", "forward+backward")
_LAST_LANES = ("examples per worker", "other collectives", "optimizer update")


def _lane_order(lane):
    if lane in _FIRST_LANES:
        return (0, _FIRST_LANES.index(lane), 0, lane)
    if lane.startswith("bucket "):
        number, _, rest = lane[len("bucket "):].partition(" ")
        return (1, int(number) if number.isdigit() else 0, len(rest), lane)
    base = lane.split(" #")[0]
    return (2, _LAST_LANES.index(base) if base in _LAST_LANES else len(_LAST_LANES), 0, lane)


def _collective_name(record):
    name = f"{record.get('op', 'collective')} on group {record.get('group')} " \
           f"of {record.get('group_size')}"
    if record.get("purpose") and record.get("purpose") != "gradients":
        name = f"{record['purpose']}: {name}"
    return name


def _stack_overlapping(events):
    """Gives each event a lane of its own kind where it overlaps none:
    collectives of one bucket run concurrently (chunks, groups), and events
    in one lane must nest."""
    ends = {}  # lane -> end of its last event
    for event in sorted(events, key=lambda e: e["ts"]):
        base, level = event["lane"], 1
        while True:
            lane = base if level == 1 else f"{base} #{level}"
            if ends.get(lane, float("-inf")) <= event["ts"]:
                break
            level += 1
        event["lane"] = lane
        ends[lane] = event["ts"] + event["dur"]
    return events


def worker_trace(worker, spans, collectives, clock_offset_seconds, host):
    """One worker's trace: a dict in the Trace Event Format.

    Args:
        worker: the worker's rank (its process id in the trace).
        spans: `TimelineStamps.records()`: dicts with name, lane, step, start
            and end (Unix seconds).
        collectives: `FlightRecorder.records()` with `completed_time`; those
            not completed are left out.
        clock_offset_seconds: this worker's clock minus the chief's.
        host: this worker's host name.
    """
    # Microseconds from the worker's first stamp, to the nanosecond: Unix
    # microseconds (about 1.8e15) keep a quarter of one, and a child's end
    # could then pass its parent's.
    completed = [r for r in collectives if r.get("completed_time") is not None]
    origin = min([s["start"] for s in spans] + [r["issued"] for r in completed],
                 default=0.0)

    def micros(seconds):
        return round((seconds - origin) * 1e6, 3)

    events = []
    for span in spans:
        events.append(dict(
            name=span["name"], lane=span["lane"], ts=micros(span["start"]),
            dur=round(micros(span["end"]) - micros(span["start"]), 3),
            args={k: v for k, v in span.items()
                  if k not in ("name", "lane", "start", "end", "indices")}))
    calls = []
    for record in completed:
        lane = record.get("lane") or ""
        calls.append(dict(
            name=_collective_name(record),
            lane=f"{lane} collectives" if lane.startswith("bucket ") else "other collectives",
            ts=micros(record["issued"]),
            dur=round(micros(record["completed_time"]) - micros(record["issued"]), 3),
            args={k: record.get(k) for k in (
                "step", "purpose", "bucket", "algorithm", "dtype", "elements",
                "group", "group_size", "sequence", "variables") if record.get(k) is not None}))
    events += _stack_overlapping(calls)
    lanes = sorted({e["lane"] for e in events}, key=_lane_order)
    tids = {lane: number for number, lane in enumerate(lanes)}
    trace = [dict(ph="M", name="process_name", pid=worker, tid=0,
                  args={"name": f"worker {worker}"}),
             dict(ph="M", name="process_sort_index", pid=worker, tid=0,
                  args={"sort_index": worker})]
    for lane, tid in tids.items():
        trace.append(dict(ph="M", name="thread_name", pid=worker, tid=tid,
                          args={"name": lane}))
        trace.append(dict(ph="M", name="thread_sort_index", pid=worker, tid=tid,
                          args={"sort_index": tid}))
    for event in events:
        trace.append(dict(ph="X", name=event["name"], cat=event["lane"], pid=worker,
                          tid=tids[event["lane"]], ts=event["ts"], dur=event["dur"],
                          args=event["args"]))
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"worker": worker, "host": host, "origin_unix_seconds": origin,
                          "clock_offset_seconds": clock_offset_seconds}}


def write(path, trace):
    """Writes `trace` to `path` whole or not at all."""
    _atomic.write_json(path, trace)
    return path


def merge(directory, output=None):
    """Joins `directory`'s worker files into one trace (written to
    `output`, default `directory/timeline.json`), on the chief's clock, in
    microseconds from the earliest event. Returns the output's path."""
    paths = sorted(glob.glob(os.path.join(directory, FILE_PATTERN)))
    if not paths:
        raise FileNotFoundError(
            f"No {FILE_PATTERN} in {directory}: run the job with "
            "CommunicationOptions(timeline=DIR) or tfscale-train --timeline=DIR first.")
    traces = []
    for path in paths:
        with open(path) as f:
            traces.append(json.load(f))
    chief = min(traces, key=lambda t: t["otherData"]["worker"])["otherData"]
    for trace in traces:
        worker = trace["otherData"]
        # One host has one clock: the measured offset there is only noise.
        worker["applied_offset_seconds"] = (
            0.0 if worker["host"] == chief["host"] else worker["clock_offset_seconds"])
    # Each worker's first stamp on the chief's clock; the earliest is 0.
    starts = [t["otherData"]["origin_unix_seconds"] - t["otherData"]["applied_offset_seconds"]
              for t in traces]
    origin = min(starts)
    shifted = []
    for trace, start in zip(traces, starts):
        shift = (start - origin) * 1e6
        for event in trace["traceEvents"]:
            if "ts" in event:
                event = dict(event, ts=round(event["ts"] + shift, 3))
            shifted.append(event)
    merged = {"traceEvents": shifted, "displayTimeUnit": "ms",
              "otherData": {"workers": [t["otherData"] for t in traces],
                            "origin_unix_seconds": origin}}
    return write(output or os.path.join(directory, MERGED), merged)


def _read(path):
    """The complete events of a merged trace, and {(pid, tid): lane name}."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    return [e for e in events if e.get("ph") == "X"], lanes


def step_times(path):
    """Per worker and step of the merged trace at `path`, in milliseconds:
    the step; the communication left after forward+backward (from its end to
    the last bucket's end); and how far apart the buckets started (from the
    first bucket's first collective to the last bucket's first). A list of
    dicts with worker, step, step_ms, after_backprop_ms, bucket_start_spread_ms
    (None where the trace lacks the spans)."""
    events, lanes = _read(path)
    steps = {}
    for e in events:
        number = e["args"].get("step")
        if number is None:
            continue
        lane = lanes.get((e["pid"], e["tid"]), "")
        record = steps.setdefault((e["pid"], number), {"first_issue": {}})
        end = e["ts"] + e["dur"]
        if lane == "step":
            record["step"] = e["dur"]
        elif lane == "forward+backward":
            record["backprop_end"] = end
        elif lane.startswith("bucket ") and e["name"] == lane:
            record["buckets_end"] = max(record.get("buckets_end", end), end)
        elif lane.startswith("bucket ") and " collectives" in lane:
            bucket = lane.partition(" collectives")[0]
            first = record["first_issue"]
            first[bucket] = min(first.get(bucket, e["ts"]), e["ts"])
    result = []
    for (worker, number), record in sorted(steps.items()):
        first = record["first_issue"].values()
        after = (record["buckets_end"] - record["backprop_end"]
                 if "buckets_end" in record and "backprop_end" in record else None)
        result.append(dict(
            worker=worker, step=number,
            step_ms=record["step"] / 1e3 if "step" in record else None,
            after_backprop_ms=None if after is None else after / 1e3,
            bucket_start_spread_ms=(max(first) - min(first)) / 1e3 if first else None))
    return result


def summary(path, skip_steps=3):
    """The medians of `step_times` over every worker's steps after its first
    `skip_steps` (tracing, warm-up), as a dict; and a line saying them."""
    rows = step_times(path)
    if not rows:
        raise ValueError(f"The trace {path} has no step spans.")
    first = min(r["step"] for r in rows) + skip_steps
    kept = [r for r in rows if r["step"] >= first]
    if not kept:
        raise ValueError(f"The trace {path} has no step after its first {skip_steps}.")
    medians = {}
    for key in ("step_ms", "after_backprop_ms", "bucket_start_spread_ms"):
        values = sorted(r[key] for r in kept if r[key] is not None)
        medians[key] = (values[len(values) // 2] if len(values) % 2
                        else sum(values[len(values) // 2 - 1:len(values) // 2 + 1]) / 2
                        ) if values else None
    medians.update(steps=sorted({r["step"] for r in kept}),
                   workers=sorted({r["worker"] for r in kept}))

    def ms(value):
        return "-" if value is None else f"{value:.1f} ms"

    line = (f"steps {medians['steps'][0]}-{medians['steps'][-1]} of "
            f"{len(medians['workers'])} worker(s), medians: step {ms(medians['step_ms'])}; "
            f"communication after forward+backward {ms(medians['after_backprop_ms'])}; "
            f"first and last bucket started {ms(medians['bucket_start_spread_ms'])} apart")
    return medians, line


def plot(path, step, output):
    """Draws `step` of every worker of the merged trace at `path` to the
    PNG `output`: a row per worker and lane, a bucket's collectives as thin
    bars along the bottom of its row, time from the step's first stamp."""
    matplotlib = _requirements.import_extra("matplotlib", "plots", "The timeline's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events, lanes = _read(path)
    chosen = [e for e in events if e["args"].get("step") == step]
    if not chosen:
        raise ValueError(f"The trace {path} has no span of step {step}.")
    origin = min(e["ts"] for e in chosen)

    def row(event):  # (worker, lane drawn in), whether it is a collective
        lane = lanes.get((event["pid"], event["tid"]), "")
        if lane.startswith("bucket ") and " collectives" in lane:
            return (event["pid"], lane.partition(" collectives")[0]), True
        return (event["pid"], lane), lane.startswith("other collectives")

    rows = sorted({row(e)[0] for e in chosen}, key=lambda r: (r[0], _lane_order(r[1])))
    figure, axes = plt.subplots(figsize=(12, 0.3 * len(rows) + 1.2))
    colours = {}
    palette = plt.get_cmap("tab10")
    for e in chosen:
        (pid, lane), collective = row(e)
        y = rows.index((pid, lane))
        name = "collective" if collective else (
            "bucket" if e["name"].startswith("bucket ") else e["name"])
        colour = colours.setdefault(name, palette(len(colours) % 10))
        bottom, height = (y + 0.15, 0.25) if collective else (y - 0.4, 0.55)
        if name == "bucket":
            bottom, height, colour = y - 0.45, 0.9, "#dddddd"
        axes.broken_barh([((e["ts"] - origin) / 1e3, max(e["dur"] / 1e3, 0.2))],
                         (bottom, height), color=colour, edgecolor="black", linewidth=0.2,
                         label=name)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left",
                bbox_to_anchor=(1.0, 1.0))
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels([f"worker {pid}: {lane}" for pid, lane in rows], fontsize=7)
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_xlabel("ms from the step's first stamp")
    axes.set_title(f"tfscale timeline, step {step}")
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tfscale.timeline",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="join the workers' files into one")
    merging.add_argument("directory")
    merging.add_argument("-o", "--output", default=None)
    plotting = commands.add_parser("plot", help="draw one step of a merged file")
    plotting.add_argument("path")
    plotting.add_argument("--step", type=int, required=True)
    plotting.add_argument("-o", "--output", required=True)
    summarizing = commands.add_parser(
        "summary", help="medians of the step, the communication left after "
        "forward+backward, and the spread of the buckets' starts")
    summarizing.add_argument("path")
    summarizing.add_argument("--skip_steps", type=int, default=3,
                             help="each worker's first steps left out (tracing, warm-up)")
    args = parser.parse_args(argv)
    try:
        if args.command == "merge":
            print(f"merged timeline: {merge(args.directory, args.output)}")
        elif args.command == "summary":
            print(summary(args.path, args.skip_steps)[1])
        else:
            print(f"plot: {plot(args.path, args.step, args.output)}")
    except (OSError, ValueError) as error:
        print(f"python -m tfscale.timeline {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
