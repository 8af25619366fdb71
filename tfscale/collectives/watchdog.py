"""The collective timeout, kept by one thread per worker.

TensorFlow's own timeout of a collective op (its `timeout` argument) keeps
each op's deadline on a thread of its own that sleeps for the whole timeout
(`Env::SchedClosureAfter` in tsl's POSIX env: "Consuming a thread here is
wasteful"). A worker issuing a few hundred collectives a second under a 300 s
timeout holds tens of thousands of sleeping threads, until creating the next
one fails ("Resource temporarily unavailable"), soonest where many workers
share a machine. tests/test_watchdog.py checks that tfscale's steps add no
threads.

So tfscale's collectives run without TensorFlow's timeout. Each counts itself
issued (once its input is ready) and completed in two int64 variables, and
one thread per worker reads them every second: when collectives are pending
and none has completed for `timeout_seconds`, it aborts this worker's
collective ops, as TensorFlow's own health check does on a lost peer, and
every pending collective fails with a message naming the timeout. A dead or
stopped peer is noticed sooner, by TensorFlow's heartbeats; the timeout
bounds the rest (a peer alive but stuck, or issuing other collectives).

Building a new strategy re-creates this process's collective runtime, which
must not happen while another thread runs TensorFlow ops (seen: "Mutex
corrupt" and an abort, with 16 workers): `stop_all` stops every watchdog
first, and the new strategy starts its own.
"""

import sys
import threading
import time

import tensorflow as tf

from tfscale._private import accessors
from tfscale._private import graph_order

# How often the watchdog thread reads the counters.
POLL_SECONDS = 1.0
# ResourceCountUpTo's limit, never reached.
_NO_LIMIT = 2**63 - 1
# The watchdogs whose threads run.
_running = []


def stop_all():
    """Stops every watchdog of this process and waits until none reads its
    counters (before TensorFlow's collective runtime is re-created)."""
    while _running:
        _running.pop().stop()


class Watchdog:
    """Aborts this worker's collectives once pending ones have waited
    `timeout_seconds` with none completing.

    Args:
        timeout_seconds: the collective timeout, > 0.
        device: this worker's device; the counters live on its host's CPU
            (the fetch-and-add below has no GPU kernel).
        abort: `fn(message)` that fails every pending and later collective of
            this process with `message` (`tf_collectives.abort_collectives`).
        poll_seconds: how often the counters are read.
        recorder: a `flight_recorder.FlightRecorder` that records each
            collective, and reports before the timeout aborts; or None.
    """

    def __init__(self, timeout_seconds, device, abort, poll_seconds=POLL_SECONDS,
                 recorder=None):
        self.timeout_seconds = timeout_seconds
        self.recorder = recorder
        self._abort = abort
        self._poll_seconds = poll_seconds
        host_cpu = tf.DeviceSpec.from_string(device).replace(
            device_type="CPU", device_index=0)
        with tf.device(host_cpu), tf.init_scope():
            self.issued = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="collectives_issued")
            self.completed = tf.Variable(0, dtype=tf.int64, trainable=False,
                                         name="collectives_completed")
        self.aborted_with = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="tfscale-collective-watchdog")
        self._thread.start()
        _running.append(self)

    def __call__(self, issue, inputs=(), site=None):
        """`issue()` (a collective op, described by `site`), counted: issued
        once `inputs` are ready, completed once its results are; and
        recorded (not inside XLA, which has no `tf.timestamp`)."""
        in_xla = accessors.in_xla_context()
        recorder = None if in_xla else self.recorder
        # The collective waits for its inputs only: the count and the row run
        # beside it, off its path (a few small ops cost milliseconds each on
        # busy cores: BENCHMARKS.md, section "The fixed cost of one
        # collective"), and still run when it hangs.
        with tf.control_dependencies(list(inputs)):
            if in_xla:
                # XLA has no kernel for the fetch-and-add below.
                sequence = tf.convert_to_tensor(self.issued.assign_add(1))
            else:
                # An atomic fetch-and-add, read once and in no program order:
                # `assign_add` returns a read of the variable made when it is
                # used, and tf.function orders every op on `issued` as
                # written, so the next collective's count would wait for this
                # one's completion, and the buckets would run one at a time.
                sequence = graph_order.unordered(tf.raw_ops.ResourceCountUpTo(
                    resource=self.issued.handle, limit=_NO_LIMIT, T=tf.int64)) + 1
            if recorder is not None:
                recorder.issued(sequence, dict(site or {}))
            result = issue()
        # Completed after counted: the watchdog never sees more completed
        # collectives than issued.
        results = tf.nest.flatten(result)
        with tf.control_dependencies(results + [sequence]):
            self.completed.assign_add(1)
        if recorder is not None:
            recorder.completed(sequence, after=results)
        return result

    def pending(self):
        """Collectives issued and not completed on this worker."""
        completed = int(self.completed.numpy())
        return int(self.issued.numpy()) - completed, completed

    def stop(self):
        """Stops the thread, and returns once it has ended."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self):
        last_completed, since = None, time.monotonic()
        while not self._stop.wait(self._poll_seconds):
            pending, completed = self.pending()
            now = time.monotonic()
            if pending <= 0 or completed != last_completed:
                last_completed, since = completed, now
                continue
            if now - since >= self.timeout_seconds:
                if self.recorder is not None:
                    print(self.recorder.report("the collective timeout"),
                          file=sys.stderr, flush=True)
                self.aborted_with = (
                    f"tfscale: {pending} collective(s) of this worker waited "
                    f"{self.timeout_seconds:g} s for the other workers with none "
                    "completing (the collective timeout, "
                    "CommunicationOptions.timeout_seconds): another worker is "
                    "hung, far behind, or issuing other collectives.")
                self._abort(self.aborted_with)
                return
