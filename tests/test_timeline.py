"""The timeline (tfscale.timeline, tfscale.collectives.timeline_stamps): a
4-worker run's merged trace holds every worker and bucket, and its spans
nest; the file format, the merge's clock offsets and the options without
workers."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf
from tensorflow.python.framework import auto_control_deps

from multiworker import assert_succeeded
from multiworker import launch_workers
from tfscale import timeline
from tfscale._private import graph_order


def _lanes(trace):
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "thread_name"}


def _spans(trace):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


# Times are microseconds to the nanosecond (tf.timestamp's resolution is
# one microsecond): sums of two of them may be off by float rounding.
EPSILON = 1e-3


def _inside(inner, outer):
    return (outer["ts"] - EPSILON <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + EPSILON)


def _misnested(events):
    """Pairs of events of one lane that overlap without one holding the other."""
    by_lane = {}
    for e in events:
        by_lane.setdefault((e["pid"], e["tid"]), []).append(e)
    bad = []
    for lane in by_lane.values():
        lane.sort(key=lambda e: (e["ts"], -e["dur"]))
        for i, a in enumerate(lane):
            for b in lane[i + 1:]:
                if b["ts"] >= a["ts"] + a["dur"] - EPSILON:
                    break
                if not _inside(b, a):
                    bad.append((a, b))
    return bad


@pytest.mark.multiworker
def test_a_4_worker_run_merges_with_every_worker_and_bucket_and_spans_nest(tmp_path):
    out = tmp_path / "timeline"
    run = launch_workers("timeline_worker.py", 4, tmp_path, args=[str(out)], timeout=240,
                         why="each worker writes its timeline when its process exits")
    assert_succeeded(run)
    assert sorted(os.listdir(out)) == [f"worker-{i}.json" for i in range(4)], run.output[-3000:]
    merged = subprocess.run([sys.executable, "-m", "tfscale.timeline", "merge", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    trace = json.loads((out / "timeline.json").read_text())
    spans, lanes = _spans(trace), _lanes(trace)
    buckets = run.results[0]["buckets"]
    assert buckets == 4  # one per tensor of the two Dense layers
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    for worker in range(4):
        mine = [e for e in spans if e["pid"] == worker]
        steps = [e for e in mine if e["name"] == "train step"]
        assert len(steps) >= 5, sorted({e["name"] for e in mine})
        step = steps[-1]["args"]["step"]
        of_step = [e for e in mine if e["args"].get("step") == step]
        names = {(lanes[(worker, e["tid"])], e["name"]) for e in of_step}
        for lane in ("forward+backward", "optimizer update"):
            assert (lane, lane) in names, names
        for number in range(buckets):
            lane = f"bucket {number}"
            for stage in (lane, "fuse", "compress", "hierarchical", "decompress", "unpack"):
                assert (lane, stage) in names, (lane, stage, names)
            bucket = next(e for e in of_step if lanes[(worker, e["tid"])] == lane
                          and e["name"] == lane)
            algorithm = next(e for e in of_step if lanes[(worker, e["tid"])] == lane
                             and e["name"] == "hierarchical")
            assert _inside(bucket, steps[-1]) and _inside(algorithm, bucket)
            calls = [e for e in of_step
                     if lanes[(worker, e["tid"])].startswith(f"{lane} collectives")]
            # Within the node (all workers), and the node's broadcast.
            assert len(calls) >= 2, calls
            assert all(_inside(c, algorithm) for c in calls), (calls, algorithm)
    assert not _misnested(spans), _misnested(spans)[:3]


def test_the_hook_lets_timestamps_run_where_their_inputs_put_them(monkeypatch):
    # TensorFlow chains every timestamp after the one traced before it;
    # tfscale's stamps must not be chained (see graph_order). Restored after.
    monkeypatch.setattr(auto_control_deps, "ASYNC_STATEFUL_OPS",
                        auto_control_deps.ASYNC_STATEFUL_OPS)

    def chained():
        @tf.function(autograph=False)
        def two_stamps():
            return tf.timestamp(), tf.timestamp()

        graph = two_stamps.get_concrete_function().graph
        stamps = [op for op in graph.get_operations() if op.type == "Timestamp"]
        return any(op.control_inputs for op in stamps)

    assert chained()  # TensorFlow's rule, which the hook exists to lift
    graph_order.unorder_timestamps()
    assert not chained()


def _trace(worker, host, offset, start):
    spans = [dict(name="train step", lane="step", step=3, start=start, end=start + 0.050),
             dict(name="bucket 0", lane="bucket 0", step=3, start=start + 0.010,
                  end=start + 0.030, bucket=0)]
    # Two chunks' collectives at once: they must land in two lanes.
    calls = [dict(op="all_reduce", group=1, group_size=2, step=3, lane="bucket 0",
                  issued=start + 0.011 + 0.001 * i, completed=True,
                  completed_time=start + 0.020) for i in range(2)]
    calls.append(dict(op="all_reduce", group=1, group_size=2, issued=start, completed=False))
    return timeline.worker_trace(worker, spans, calls, offset, host)


def test_a_worker_trace_has_its_lanes_and_stacks_overlapping_collectives():
    trace = _trace(1, "a", 0.0, 1000.0)
    lanes = sorted(_lanes(trace).values())
    assert lanes == ["bucket 0", "bucket 0 collectives", "bucket 0 collectives #2", "step"]
    spans = _spans(trace)
    assert len(spans) == 4  # the pending collective is left out
    assert not _misnested(spans)
    assert {e["pid"] for e in trace["traceEvents"]} == {1}


def test_merge_shifts_other_hosts_by_their_measured_offset(tmp_path):
    # Worker 1 on the chief's host (one clock: its measured 3 ms is noise),
    # worker 2 on another host whose clock runs 2 s ahead.
    for worker, host, offset in ((0, "a", 0.0), (1, "a", 0.003), (2, "b", 2.0)):
        timeline.write(str(tmp_path / f"worker-{worker}.json"),
                       _trace(worker, host, offset, 1000.0 + offset))
    merged = json.loads(open(timeline.merge(str(tmp_path))).read())
    starts = {e["pid"]: e["ts"] for e in _spans(merged) if e["name"] == "train step"}
    assert starts[0] == 0.0
    assert starts[1] == pytest.approx(3000.0)  # microseconds: not shifted
    assert starts[2] == pytest.approx(0.0, abs=1e-3)  # shifted by 2 s
    assert [w["applied_offset_seconds"] for w in merged["otherData"]["workers"]] == [
        0.0, 0.0, 2.0]


def test_merge_of_an_empty_directory_says_what_to_run(tmp_path, capsys):
    assert timeline.main(["merge", str(tmp_path)]) == 1
    assert ("No worker-*.json in" in capsys.readouterr().err)


def test_plot_draws_a_step(tmp_path):
    for worker in (0, 1):
        timeline.write(str(tmp_path / f"worker-{worker}.json"),
                       _trace(worker, "a", 0.0, 1000.0))
    path = timeline.merge(str(tmp_path))
    png = tmp_path / "step.png"
    assert timeline.main(["plot", path, "--step", "3", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="has no span of step 9"):
        timeline.plot(path, 9, str(png))



def _step_with_two_buckets(step, start, backprop_ms, bucket_starts_ms, bucket_ends_ms):
    spans = [dict(name="train step", lane="step", step=step, start=start, end=start + 0.1),
             dict(name="forward+backward", lane="forward+backward", step=step, start=start,
                  end=start + backprop_ms / 1e3)]
    calls = []
    for number, (begin, end) in enumerate(zip(bucket_starts_ms, bucket_ends_ms)):
        spans.append(dict(name=f"bucket {number}", lane=f"bucket {number}", step=step,
                          start=start + begin / 1e3 - 0.001, end=start + end / 1e3))
        calls.append(dict(op="all_reduce", group=1, group_size=2, step=step,
                          lane=f"bucket {number}", issued=start + begin / 1e3,
                          completed=True, completed_time=start + end / 1e3 - 0.001))
    return spans, calls


def test_summary_gives_the_medians_after_the_skipped_steps(tmp_path, capsys):
    spans, calls = [], []
    # Step 0 (skipped) is slow; steps 1-3: backprop ends at 60 ms, buckets
    # start at 20 and 50 + step ms and the last ends at 80 + step ms.
    for step in range(4):
        slow = 500 if step == 0 else 0
        more = _step_with_two_buckets(step, 1000.0 + step, 60, (20, 50 + step + slow),
                                      (70, 80 + step + slow))
        spans += more[0]
        calls += more[1]
    timeline.write(str(tmp_path / "worker-0.json"),
                   timeline.worker_trace(0, spans, calls, 0.0, "a"))
    path = timeline.merge(str(tmp_path))
    medians, line = timeline.summary(path, skip_steps=1)
    assert medians["steps"] == [1, 2, 3] and medians["workers"] == [0]
    assert medians["step_ms"] == pytest.approx(100.0)
    assert medians["after_backprop_ms"] == pytest.approx(22.0)  # 80 + 2 - 60
    assert medians["bucket_start_spread_ms"] == pytest.approx(32.0)  # 50 + 2 - 20
    assert timeline.main(["summary", path, "--skip_steps", "1"]) == 0
    assert "steps 1-3 of 1 worker(s)" in capsys.readouterr().out
