"""Waiting for the other workers to start, in Python, before TensorFlow does.

MultiWorkerMirroredStrategy's constructor connects to TensorFlow's
coordination service and waits there, inside one C++ call that holds the GIL,
until every chief/worker task has registered: a peer that never starts leaves
it silent (the service logs "Waiting for 1/2 tasks to connect" once, and
only on task 0) for the service's register timeout (an hour by default; task
0 waits on even after it), deaf to Ctrl-C (Python's handler cannot run) and
to SIGTERM (TensorFlow's preemption notifier installs its own handler during
that call and only logs "SIGTERM caught").

So tfscale waits for its peers first, where Python still runs: each worker
listens on the port of its own cluster address and connects to its peers'
until it has reached every one of them once. A peer reached has started: it
either still waits the same way or is already inside TensorFlow, whose gRPC
server listens on the same port. Each worker closes its listener before
TensorFlow binds that port. While it waits, a worker names the peers it has
not reached every 30 s, gives up after its timeout, and stops at SIGINT or
SIGTERM; each raises `StartupError` naming the peers it waited for.

A peer that starts but dies before it has connected to TensorFlow's service
(after this wait) still leaves the others in TensorFlow's wait.
"""

import contextlib
import errno
import os
import signal
import socket
import threading
import time

from absl import logging

# The default of `Strategy(startup_timeout_seconds=...)` and of tfscale-train's
# --startup_timeout. Kubernetes starts a job's pods independently: a pod on a
# node that must first pull a multi-gigabyte TensorFlow image, or that the
# autoscaler must first add, starts minutes after the others. Horovod's 30 s
# (horovodrun --start-timeout) covers processes horovodrun starts itself over
# ssh; torchrun's rendezvous waits 600 s for its nodes to join.
DEFAULT_TIMEOUT_SECONDS = 600
# The default of `Strategy(heartbeat_timeout_seconds=...)` and of
# tfscale-train's --heartbeat_timeout: how long TensorFlow's coordination
# service waits for a worker's heartbeat. TensorFlow's 10 s gives each
# heartbeat 5 s to be answered, and heartbeats share the gRPC channel with
# the tensors: behind the broadcast of AlexNet-BN's 203 MB of weights on a
# 200 Mbit/s link (about 8 s) a reply waits longer, and the job stops
# (docs/failures.md, the row on a slow link). 60 s gives 30 s. The price: a
# lost peer is noticed later, within the timeout, unless a launcher stops
# the job first as tfscale-launch does
# (tests/reliability/test_worker_failure.py).
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 60.0
# Longest interval between two reports of the peers still missing.
REPORT_SECONDS = 30
# Connecting to a peer that has not started is refused at once (or, for a host
# that does not answer, times out after this).
_CONNECT_SECONDS = 1.0
_POLL_SECONDS = 0.5
# Names listed in one message at most.
_MAX_NAMED = 8
_JOBS = ("chief", "worker")


class StartupError(RuntimeError):
    """The cluster did not start: a peer never did, or a signal stopped the wait.

    Attributes:
        missing: names of the tasks never reached, as `"worker 1 (host:port)"`.
        signum: the `signal.Signals` (SIGINT, SIGTERM) that stopped the
            wait, or `None` when it gave up after its timeout or could not
            start waiting.
    """

    def __init__(self, message, missing=(), signum=None):
        super().__init__(message)
        self.missing = list(missing)
        self.signum = signum


class _Stopped(Exception):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def cluster_tasks(cluster_spec):
    """`[(name, address)]` of the tasks that train: chief first, then workers.

    Args:
        cluster_spec: `{job: [address, ...]}` (or `{job: {index: address}}`),
            as `tf.train.ClusterSpec.as_dict()` returns it.
    """
    tasks = []
    for job in _JOBS:
        addresses = cluster_spec.get(job) or []
        if not isinstance(addresses, dict):
            addresses = dict(enumerate(addresses))
        tasks += [(f"{job} {index}", addresses[index]) for index in sorted(addresses)]
    return tasks


def wait_for_peers(cluster_spec, task_type, task_id,
                   timeout_seconds=DEFAULT_TIMEOUT_SECONDS):
    """Returns once every other chief/worker task of the cluster has started.

    Listens on this task's port meanwhile (peers see this task has started)
    and closes it again before returning. Call it in every worker before
    TensorFlow's server starts; `tfscale.Strategy` does. A no-op for a single
    worker and for tasks that do not train (`evaluator`, `ps`).

    While it waits it logs the peers not reached yet: at first, then every
    30 s or every quarter of `timeout_seconds`, whichever is shorter. Called
    from the main thread it turns SIGINT and SIGTERM (unless ignored) into
    `StartupError`, and restores their handlers before returning.

    Args:
        cluster_spec: `{job: [address, ...]}`, as in TF_CONFIG's `cluster`.
        task_type: this task's job (`"chief"`, `"worker"`, ...).
        task_id: this task's index in its job.
        timeout_seconds: give up after this many seconds; `None` waits as long
            as it takes.

    Raises:
        StartupError: a peer had not started after `timeout_seconds`, or
            SIGINT/SIGTERM arrived while waiting, or this task cannot listen
            on its own port.
    """
    tasks = cluster_tasks(cluster_spec)
    own_name = f"{task_type} {task_id}"
    if len(tasks) < 2 or own_name not in dict(tasks):
        return
    own_address = dict(tasks)[own_name]
    waiting = _Waiting([task for task in tasks if task[0] != own_name])
    listener = _listen(own_name, own_address)
    try:
        with _signals_raise_stopped():
            waiting.run(timeout_seconds)
    except _Stopped as stopped:
        missing = waiting.missing()
        signum = signal.Signals(stopped.signum)
        raise StartupError(
            f"stopped by {signum.name} while waiting for {_list(missing)} to "
            "start.", missing, signum) from None
    finally:
        listener.close()


class _Waiting:
    """The peers, and which of them have been reached."""

    def __init__(self, peers):
        self.peers = peers
        self.reached = set()

    def missing(self):
        return [f"{name} ({address})" for name, address in self.peers
                if name not in self.reached]

    def run(self, timeout_seconds):
        """Connects to each missing peer until none is left; reports, gives up."""
        start = time.monotonic()
        report_every = REPORT_SECONDS
        limit = "no time limit"
        if timeout_seconds is not None:
            report_every = min(REPORT_SECONDS, timeout_seconds / 4)
            limit = f"giving up after {timeout_seconds:g} s"
        next_report = start
        while True:
            for name, address in self.peers:
                if name not in self.reached and _accepts_connections(address):
                    self.reached.add(name)
            missing = self.missing()
            if not missing:
                return
            elapsed = time.monotonic() - start
            if timeout_seconds is not None and elapsed >= timeout_seconds:
                they, them = ("it", "it") if len(missing) == 1 else ("they", "them")
                raise StartupError(
                    f"gave up after {timeout_seconds:g} s waiting for "
                    f"{_list(missing)} to start: {they} never accepted a "
                    f"connection. Start {them}, or check the cluster's "
                    "addresses (TF_CONFIG).", missing)
            if time.monotonic() >= next_report:
                # The first report tells; the later ones warn.
                log = logging.info if next_report == start else logging.warning
                log("tfscale: waiting for %s to start (%d s so far; %s).",
                    _list(missing), elapsed, limit)
                next_report += report_every
            time.sleep(_POLL_SECONDS)


def _list(names):
    shown = ", ".join(names[:_MAX_NAMED])
    if len(names) > _MAX_NAMED:
        shown += f" and {len(names) - _MAX_NAMED} more"
    return shown


def _split(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _accepts_connections(address):
    try:
        with socket.create_connection(_split(address), timeout=_CONNECT_SECONDS):
            return True
    except OSError:  # refused, unreachable, not (yet) in DNS, timed out
        return False


def _listen(own_name, own_address):
    """A socket listening on `own_address`'s port, on every interface (where
    TensorFlow's server listens)."""
    port = _split(own_address)[1]
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6,
                                        dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as error:
        advice = ""
        if error.errno == errno.EADDRINUSE:
            advice = (" Another process holds it: stop that one, or give this "
                      "task another port in the cluster (TF_CONFIG).")
        raise StartupError(
            f"{own_name} cannot listen on port {port} of its address "
            f"{own_address}: {os.strerror(error.errno)}.{advice}") from error


@contextlib.contextmanager
def _signals_raise_stopped():
    """Within the block, SIGINT and SIGTERM raise `_Stopped` in the main thread
    (ignored ones stay ignored; other threads cannot set handlers); the
    previous handlers come back after it."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if handler not in (signal.SIG_IGN, None):  # None: not set from Python
                previous[signum] = handler
                signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise_stopped(signum, frame):
    raise _Stopped(signum)
