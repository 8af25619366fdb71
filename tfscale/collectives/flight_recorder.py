"""The flight recorder: this worker's last collectives, to say where a job broke.

A job that hangs or dies inside a collective shows TensorFlow's words for it
("Shape mismatch in the collective instance 113", "The following tasks are
unhealthy"): an instance number that names nothing the user wrote. So every
collective tfscale issues (through the watchdog, `watchdog.Watchdog`) also
writes one row of a ring buffer kept in a variable on this worker: which call
site it is, the training step, when it was issued, and whether it completed.
(Not when: a `tf.timestamp` after each collective's result would keep the
gradient buckets from overlapping backprop;
tests/test_collectives.py::test_bucket_all_reduces_overlap_backprop checks
the overlap.) A
call site is described once, when the step is traced: the op, its group, its
dtype and size, and what tfscale was doing around it (the bucket, its
algorithm, the variables whose gradients it carries), given by `context`.

When a job fails with collectives pending (at exit, or when the watchdog's
timeout fires), `report` prints a few lines per worker: what it waits for
and what it last completed, then one `tfscale-flight {json}` line that
tfscale-launch gathers from every worker to name the one(s) behind
(`tfscale.flight_report.summarize`). `TFSCALE_FLIGHT_RECORDER=DIR` writes each worker's records
to DIR/worker-I.json at exit.

After PyTorch's flight recorder (torch/csrc/distributed/c10d/
FlightRecorder.hpp: a ring buffer of the last collectives per rank, dumped
on a timeout) and Horovod's stall inspector (horovod/common/
stall_inspector.cc: which ranks have not submitted a tensor the others wait
on). Its cost per collective and per step: BENCHMARKS.md, section "The
flight recorder's cost" (`python -m
tfscale.launch.studies.flight_recorder_cost`).
"""

import contextlib
import json
import os
import time

import numpy as np
import tensorflow as tf

from tfscale import flight_report
from tfscale import _atomic
from tfscale._private import accessors
from tfscale._private import graph_order
from tfscale.collectives import timeline_stamps
from tfscale.flight_report import LINE_PREFIX
from tfscale.flight_report import describe

# Rows kept: the last CAPACITY collectives of this worker.
CAPACITY = 512
DUMP_ENV = "TFSCALE_FLIGHT_RECORDER"
# Columns of a row of `rows` (completion times are kept apart, see __init__).
_SITE, _STEP, _SEQUENCE, _ISSUED = range(4)


class FlightRecorder:
    """Records this worker's collectives (see the module).

    Args:
        device: this worker's device, where the rows live.
        worker: this worker's index (in reports).
        capacity: rows kept.
        timeline: also stamp when each collective completed and each span
            of a step began and ended (`timeline_stamps`), for
            `CommunicationOptions(timeline=...)`.
    """

    def __init__(self, device, worker, capacity=CAPACITY, timeline=False):
        self.worker = worker
        self.capacity = capacity
        self.sites = []  # descriptions of the call sites, by site id
        # Not per thread: a replica's function sets it, and its all-reduce
        # is traced in the strategy's thread (`merge_call`) meanwhile.
        self._contexts = []
        # Two variables: tf.function orders the writes to one resource in
        # program order, and completion marks are (they wait for results);
        # issue rows are written in no order (`issued`), so a collective
        # never waits for an earlier one's completion through its row.
        # `completed_at` holds the sequence number of the collective that
        # last completed in each slot.
        with tf.device(device), tf.init_scope():
            self.rows = tf.Variable(tf.fill([capacity, 4], tf.constant(-1.0, tf.float64)),
                                    trainable=False, name="flight_recorder_issued")
            self.completed_at = tf.Variable(
                tf.fill([capacity], tf.constant(-1.0, tf.float64)), trainable=False,
                name="flight_recorder_completed")
        self.stamps = None
        if timeline:
            graph_order.unorder_timestamps()
            self.stamps = timeline_stamps.TimelineStamps(device)
            with tf.device(device), tf.init_scope():
                self.completed_time = tf.Variable(
                    tf.fill([capacity], tf.constant(-1.0, tf.float64)), trainable=False,
                    name="flight_recorder_completed_time")
        self.reported = False

    @contextlib.contextmanager
    def context(self, span=None, lane=None, after=(), **fields):
        """Describes the collectives traced inside it (`step`: a scalar tensor,
        the training step, recorded when each runs; the rest: descriptions).

        With the timeline on, `span` also names a span of it, drawn in `lane`
        (default: the enclosing span's), that starts once `after` are ready
        and ends once all traced inside it has run (`timeline_stamps`).
        """
        opened = None
        if span is not None and self.stamps is not None and not accessors.in_xla_context():
            parent = self._span()
            enclosing = self._enclosing(fields)
            lane = lane or (parent.lane if parent else span)
            if lane.startswith("bucket ") and enclosing.get("purpose") != "gradients":
                # Buckets of other all-reduces share one lane of their own.
                lane = enclosing.get("purpose") or "other all-reduces"
            step = enclosing.get("step")
            opened = self.stamps.open(
                span, lane, parent if parent and parent.lane == lane else None,
                after=_tensors(after) + ([parent.start] if parent else []),
                step=None if step is None else tf.cast(step, tf.float64),
                fields={k: v for k, v in fields.items() if k != "step"})
        stack = self._stack()
        stack.append(dict(fields, _span=opened) if opened else fields)
        try:
            yield
        finally:
            stack.pop()
        if opened is not None:
            parent = self._span()
            end = self.stamps.close(opened, parent if parent and parent.lane == opened.lane
                                    else None)
            for name, lane, start in opened.ends_with:
                self.stamps.write(name, lane, start, end, opened.step)

    def _stack(self):
        return self._contexts

    def _enclosing(self, fields):
        """The fields of the contexts open, the innermost's winning, and `fields`."""
        merged = {}
        for each in self._stack() + [fields]:
            merged.update(each)
        return merged

    def _span(self):
        """The innermost span open, or None."""
        for fields in reversed(self._stack()):
            if fields.get("_span") is not None:
                return fields["_span"]
        return None

    def _step_span(self):
        """The outermost span open (the step's), or None."""
        spans = [f["_span"] for f in self._stack() if f.get("_span") is not None]
        return spans[0] if spans else None

    def since_step(self, name, after):
        """With the timeline on, inside a step: a span `name` in a lane of
        its own from the step's start to when `after` are ready (so
        "forward+backward" ends where the gradients are)."""
        step = self._step_span()
        if step is None or accessors.in_xla_context():
            return
        end = self.stamps.stamp(_tensors(after) + [step.start])
        self.stamps.write(name, name, step.start, end, step.step)

    def until_step_end(self, name, after):
        """With the timeline on, inside a step: a span `name` in a lane of
        its own from when `after` are ready to the step's end (so "optimizer
        update" starts where the gradients are summed)."""
        step = self._step_span()
        if step is None or accessors.in_xla_context():
            return
        step.ends_with.append((name, name, self.stamps.stamp(_tensors(after) + [step.start])))

    def site(self, description):
        """(site id, step tensor or None) of a collective traced now."""
        merged, step = {}, None
        for fields in self._stack():
            for name, value in fields.items():
                if name == "step":
                    step = value
                elif name != "_span":
                    merged[name] = value
        span = self._span()
        if span is not None:
            merged.update(lane=span.lane, span=span.name)
        merged.update(description)
        self.sites.append(_describe_variables(merged))
        return len(self.sites) - 1, step

    def issued(self, sequence, description):
        """The op writing the row of collective number `sequence` (1, 2, ...)."""
        site, step = self.site(description)
        step = tf.constant(-1.0, tf.float64) if step is None else tf.cast(step, tf.float64)
        slot = tf.math.floormod(sequence - 1, self.capacity)
        # Issued once its inputs are (`sequence` waits for them); with the
        # timeline on, inside its span. Stamp and row run in no program
        # order (`graph_order.unordered`): ordered after the bookkeeping
        # traced before it (the previous bucket's completion,
        # `timed_all_reduce`'s stamp of the last gradient), the stamp would
        # record that moment instead of this collective's issue.
        span = self._span() if self.stamps is not None else None
        issued = graph_order.unordered(timeline_stamps.TimelineStamps.stamp(
            [sequence] + ([span.last_stamp] if span is not None else [])))
        row = tf.stack([tf.constant(float(site), tf.float64), step,
                        tf.cast(sequence, tf.float64), issued])
        # The slot's completion mark stays an older collective's until this
        # one completes (`records` compares the sequence numbers).
        return graph_order.unordered(tf.raw_ops.ResourceScatterNdUpdate(
            ref=self.rows.handle, indices=tf.reshape(slot, [1, 1]), updates=row[None]))

    def completed(self, sequence, after=()):
        """The op marking collective number `sequence` completed once `after`
        (its results) are ready; with the timeline on, also when. Only the
        row writes wait for `after`: the slot and the value are computed
        beforehand, off the path from the results to the step's end."""
        slot = tf.reshape(tf.math.floormod(sequence - 1, self.capacity), [1, 1])
        value = tf.cast(sequence, tf.float64)[None]
        with tf.control_dependencies(list(after)):
            if self.stamps is not None:
                self.completed_time.scatter_nd_update(slot, tf.timestamp()[None])
            return self.completed_at.scatter_nd_update(slot, value)

    def records(self):
        """This worker's recorded collectives, oldest first: dicts of the
        site's description and `site` (its id), `step`, `sequence`, `issued`
        (Unix seconds) and `completed` (True or False)."""
        columns = [self.rows.numpy(), self.completed_at.numpy()[:, None]]
        if self.stamps is not None:
            columns.append(self.completed_time.numpy()[:, None])
        rows = np.concatenate(columns, axis=1)
        rows = rows[rows[:, _SEQUENCE] >= 0]
        result = []
        for row in rows[np.argsort(rows[:, _SEQUENCE])]:
            site = int(row[_SITE])
            record = dict(self.sites[site]) if site < len(self.sites) else {}
            record.update(
                site=site, sequence=int(row[_SEQUENCE]),
                step=int(row[_STEP]) if row[_STEP] >= 0 else None,
                issued=float(row[_ISSUED]),
                completed=bool(row[_ISSUED + 1] == row[_SEQUENCE]))
            if self.stamps is not None and record["completed"]:
                record["completed_time"] = float(row[_ISSUED + 2])
            result.append(record)
        return result

    def position(self):
        """{"pending": the pending record every other waits behind,
        "completed": the newest completed one} (each None when there is none).

        Sequence numbers count collectives as their inputs become ready, not
        in the order they were traced: a collective with early inputs (a
        scalar all-reduce) is counted before a gradient bucket traced ahead
        of it on the same group, yet waits behind it (a group runs its
        collectives in the order traced). So the one reported is the first
        traced (lowest site) of the oldest step pending.
        """
        records = self.records()
        pending = sorted((r for r in records if not r["completed"]),
                         key=lambda r: (r["step"] is None, r["step"] or 0, r["site"],
                                        r["sequence"]))
        completed = [r for r in records if r["completed"]]
        return {"worker": self.worker,
                "pending": pending[0] if pending else None,
                "completed": completed[-1] if completed else None}

    def report(self, why=None, error=None):
        """The lines saying where this worker is (see the module), and what
        TensorFlow's `error` (if given) says the other member brought."""
        self.reported = True
        now = time.time()
        position = self.position()
        lines = [f"tfscale flight recorder, worker {self.worker}"
                 + (f" ({why})" if why else "") + ":"]
        if position["pending"]:
            pending = position["pending"]
            lines.append(f"  waits {now - pending['issued']:.1f} s in "
                         f"{describe(pending)}")
        if position["completed"]:
            completed = position["completed"]
            lines.append(f"  last completed: {describe(completed)}")
        if len(lines) == 1:
            lines.append("  no collective recorded")
        mismatch = flight_report.peer_mismatch(str(error)) if error else None
        if mismatch:
            lines.append(f"  {mismatch}")
        lines.append(LINE_PREFIX + json.dumps(position, default=str))
        return "\n".join(lines)

    def pending(self):
        """Whether some recorded collective never completed."""
        return not all(r["completed"] for r in self.records())

    def dump(self, directory):
        """Writes the records to `directory`/worker-I.json."""
        path = os.path.join(directory, f"worker-{self.worker}.json")
        _atomic.write_json(path, {"worker": self.worker, "records": self.records()},
                           default=str, indent=1)
        return path


def _tensors(values):
    """The tensors and ops of a nest (other values dropped)."""
    return [v for v in tf.nest.flatten(values, expand_composites=True)
            if isinstance(v, (tf.Tensor, tf.Operation))]


def _describe_variables(description):
    """Keeps the first and last variable names of a bucket, not all."""
    names = description.pop("variable_names", None)
    indices = description.pop("indices", None)
    if names and indices:
        picked = [names[i] for i in indices if i < len(names)]
        if picked:
            description["variables"] = (picked[0] if len(picked) == 1
                                        else f"{picked[0]} .. {picked[-1]}")
    return description
