"""The timeline's stamps: when each span of a step began and ended, on this
worker (`CommunicationOptions(timeline=...)`; the file: `tfscale.timeline`).

A span is a piece of the step that tfscale traces: the step itself, a
gradient bucket, a stage of one (fuse, compress, its algorithm, decompress,
unpack), forward+backward, the optimizer update. Each has a lane (the
row it is drawn in) and two `tf.timestamp`s: its start, taken once its
inputs are ready, and its end, taken once every op traced inside it has run.
Spans of one lane are chained (a stamp also waits for its parent's start
and its elder sibling's end), so they nest by construction; the
collectives traced inside a span (the flight recorder's rows, with their
completion stamps) nest in it the same way. Nothing that computes waits for
a stamp: the ops that write them are consumed by nothing but the step's end,
and `tfscale._private.graph_order.unorder_timestamps` keeps `tf.function`
from ordering a stamp after every stateful op traced before it.

Like Horovod's timeline (horovod/common/timeline.cc: per-tensor
NEGOTIATE/ALLREDUCE phases per rank, Chrome's trace format), but stamped in
the graph: TensorFlow 2.21's profiler, tried first, killed 1 worker in 14
in `tf.profiler.experimental.stop()` ("double free or corruption").
"""

import dataclasses
import time

import numpy as np
import tensorflow as tf

# Spans kept: the last CAPACITY of this worker (about 30 steps of a model
# with 10 buckets).
CAPACITY = 4096
# Columns of a row.
_SITE, _STEP, _START, _END = range(4)


@dataclasses.dataclass
class Span:
    """A span being traced: its stamps, and where the graph was when it opened."""

    name: str
    lane: str
    start: tf.Tensor
    step: object  # a scalar tensor, or None
    operations_before: int
    last_stamp: tf.Tensor  # the newest stamp of its children (chains them)
    fields: dict
    # (name, lane, start stamp) of spans that end when this one does.
    ends_with: list = dataclasses.field(default_factory=list)


class TimelineStamps:
    """This worker's spans, in a ring buffer of `capacity` rows.

    Args:
        device: this worker's device, where the rows live.
        capacity: rows kept.
    """

    def __init__(self, device, capacity=CAPACITY):
        self.capacity = capacity
        self.sites = []  # (name, lane, fields) of each traced span
        with tf.device(device), tf.init_scope():
            self.rows = tf.Variable(tf.fill([capacity, 4], tf.constant(-1.0, tf.float64)),
                                    trainable=False, name="timeline_spans")
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name="timeline_span_count")

    @staticmethod
    def stamp(after=()):
        """A `tf.timestamp` taken once every tensor or op in `after` is."""
        with tf.control_dependencies([a for a in tf.nest.flatten(after) if a is not None]):
            return tf.timestamp()

    def open(self, name, lane, parent, after=(), step=None, fields=None):
        """A `Span` starting once `after` are ready and, given its `parent`
        in the same lane, after the parent's newest stamp (its start, or its
        elder child's end)."""
        chained = [parent.last_stamp] if parent is not None else []
        start = self.stamp(list(tf.nest.flatten(after)) + chained)
        if parent is not None:
            parent.last_stamp = start
        return Span(name=name, lane=lane, start=start, step=step,
                    operations_before=len(tf.compat.v1.get_default_graph().get_operations()),
                    last_stamp=start, fields=dict(fields or {}))

    def close(self, span, parent=None):
        """Stamps the end of `span`, once every op traced inside it has run,
        and writes its row; returns the end stamp."""
        inside = tf.compat.v1.get_default_graph().get_operations()[span.operations_before:]
        end = self.stamp(inside + [span.last_stamp])
        if parent is not None:
            parent.last_stamp = end
        self.write(span.name, span.lane, span.start, end, span.step, span.fields)
        return end

    def write(self, name, lane, start, end, step=None, fields=None):
        """Writes one span's row (from stamps already taken)."""
        self.sites.append((name, lane, dict(fields or {})))
        step = tf.constant(-1.0, tf.float64) if step is None else tf.cast(step, tf.float64)
        row = tf.stack([tf.constant(float(len(self.sites) - 1), tf.float64), step,
                        start, end])
        slot = tf.math.floormod(self.count.assign_add(1) - 1, self.capacity)
        self.rows.scatter_nd_update(tf.reshape(slot, [1, 1]), row[None])

    def records(self):
        """This worker's spans, oldest first: dicts of `name`, `lane`, `step`,
        `start` and `end` (Unix seconds) and the fields they were traced with."""
        rows = self.rows.numpy()
        rows = rows[rows[:, _START] >= 0]
        result = []
        for row in rows[np.argsort(rows[:, _START], kind="stable")]:
            name, lane, fields = self.sites[int(row[_SITE])]
            result.append(dict(fields, name=name, lane=lane,
                               step=int(row[_STEP]) if row[_STEP] >= 0 else None,
                               start=float(row[_START]), end=float(row[_END])))
        return result


def clock_offset(gather, rounds=5):
    """This worker's clock minus the chief's, in seconds: the median over
    `rounds` of the difference of the two clocks read right after a barrier
    (an all-gather every worker leaves at about the same moment; the error
    is how unevenly they leave it, about one message's latency).

    Args:
        gather: `fn(value)` -> every worker's float `value`, chief first (a
            collective: every worker calls it the same number of times).
    """
    differences = []
    for _ in range(rounds):
        gather(0.0)  # the barrier
        now = time.time()
        differences.append(now - float(gather(now)[0]))
    return float(np.median(differences))
