r"""tfscale-launch: runs N workers of a command on this machine.

    tfscale-launch --num_workers=2 -- tfscale-train --epochs=3

Each worker is one process with its own TF_CONFIG naming a free 127.0.0.1
port for every worker, as Kubernetes or SLURM would give one per machine. Each
output line is prefixed with the worker's index. Once the workers of a launch
are started, one line names each one's slot, pid and address:

    tfscale-launch: launch 0 started worker 0 (slot 0) pid 4211 at 127.0.0.1:20480, ...

When a worker fails, the others are stopped and the launcher exits non-zero
naming the failed worker; `--timeout` bounds the whole run. The ports are
picked below the kernel's ephemeral range, where nothing takes them by chance
before the workers bind them (ports.py); should a worker still fail to bind
its port, every worker is stopped and all are relaunched on fresh ports.

    tfscale-launch --num_workers=4 --emulate_nodes=2 --inter_node_rate=200mbit -- CMD

With `--emulate_nodes=M` (root only) the workers are placed in M emulated
nodes, consecutive workers per node, each node a network namespace with its
own address; the link between nodes is rate-limited with `tc tbf`. TF_CONFIG
then names each worker's node address, so TensorFlow's gRPC crosses the
emulated links. See launch/netns.py.

TensorFlow's gRPC server listens on all interfaces, unauthenticated, whatever
address TF_CONFIG names. So by default (`--isolate=auto`), where it can (root,
network namespaces), tfscale-launch runs the workers in a network namespace of
their own, on 127.0.0.1 there: they reach each other over its loopback and
nothing outside it can reach them (nor can they reach the network). It says
which it did; `--isolate=yes` fails where it cannot, `--isolate=no` keeps the
machine's network (workers then listen on every interface).

    tfscale-launch --num_workers=3 --max_restarts=3 --min_workers=2 -- \
        tfscale-train --model_dir=/shared/run1 --global_batch_size=48

With `--max_restarts=N`, when a worker fails (exits non-zero or is killed)
the others are stopped and all are relaunched on fresh ports, up to N times
in the whole run, each restart printed with its cause; with `--model_dir`,
tfscale-train resumes from the newest checkpoint. Each worker has a slot, a
stable identity kept across restarts. With `--min_workers=M`, a slot that
fails again within `--restart_window` seconds of a restart is dropped and
the job goes on with one worker fewer, down to M workers (the global batch
must be divisible by every worker count it may run with). A worker that
exits with 143 was preempted (a SIGTERM: every worker saved the same step,
`tfscale.preemption`): the launcher gives the others `--grace_seconds` to
exit too, and relaunches it as any failure but never drops its slot for it.
Ctrl-C or SIGTERM stops every worker (SIGTERM, then SIGKILL after
`--grace_seconds`: time for tfscale-train to save) and restarts nothing.
The exit code is 0 when the last launch succeeds, otherwise that of its
failure (1 for a killed worker), 124 on `--timeout`, 130 after Ctrl-C and
143 after SIGTERM. With `--emulate_nodes`, restarts
reuse the emulated nodes on fresh ports; no slot can be dropped there (every
node runs as many workers). See launch/restarts.py.

Environment of each worker, besides the launcher's own:

    TF_CONFIG               the cluster and this worker's index in it
    TFSCALE_SLOT            this worker's slot, 0 .. --num_workers - 1; equal
                            to its index until a slot is dropped
    TFSCALE_RESTART_COUNT   restarts before this launch: 0 on the first
                            (like torchrun's TORCHELASTIC_RESTART_COUNT)
    CUDA_VISIBLE_DEVICES    with --gpus_per_node=K only: this worker's one
                            GPU, its local rank on its node (see launch/gpus.py)
    TF_NUM_INTRAOP_THREADS  this worker's share of the machine's cores, cores
                            // workers (at least 1), unless the launcher's
                            environment sets it (see launch/threads.py)

    tfscale-launch --num_workers=8 --gpus_per_node=8 -- tfscale-train ...

With `--gpus_per_node=K` each worker sees exactly one GPU: one worker per GPU,
so K must equal the workers per node (--num_workers, or --num_workers /
--emulate_nodes). A worker's GPU follows its slot across restarts. Unset,
the workers inherit the launcher's environment, CUDA_VISIBLE_DEVICES included.

    tfscale-launch --num_workers=4 --preload=tfscale.strategy -- tfscale-train ...

With `--preload=MODULES` the workers are forked from one process that
imported MODULES, so no launch or restart imports TensorFlow per worker
again; the launcher adopts them, and all of the above holds as for fresh
workers (see launch/preload.py).
"""

import atexit
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

from tfscale import flight_report
from tfscale.launch import flag_help
from tfscale.launch import gpus
from tfscale.launch import netns
from tfscale.launch import ports
from tfscale.launch import preload
from tfscale.launch import restarts
from tfscale.launch import threads

FLAGS = flags.FLAGS


def define_flags():
    """Defines tfscale-launch's flags (once) and lists them in `--help`."""
    if "num_workers" in FLAGS:
        return
    flags.DEFINE_integer("num_workers", 2, "Number of worker processes.", lower_bound=1)
    flags.DEFINE_float(
        "timeout", 0, "Stop every worker and fail after this many seconds; 0: no limit."
    )
    flags.DEFINE_float(
        "grace_seconds", 10,
        "When stopping workers: seconds between SIGTERM and SIGKILL.",
    )
    flags.DEFINE_enum(
        "isolate", "auto", ISOLATE_CHOICES,
        "Run the workers in a network namespace of their own, so nothing "
        "outside it can reach their unauthenticated gRPC ports (and they cannot "
        "reach the network). auto: where permitted (root, iproute2), saying "
        "which it did; yes: fail where not permitted; no: keep this machine's "
        "network. Emulated nodes (--emulate_nodes) are always isolated.",
    )
    flags.DEFINE_integer(
        "emulate_nodes", None,
        "Place the workers in this many emulated nodes (network namespaces, one "
        "address each, consecutive workers per node; must divide --num_workers). "
        "Needs root and iproute2. Unset: every worker on 127.0.0.1.",
    )
    flags.DEFINE_string(
        "inter_node_rate", None,
        "With --emulate_nodes: rate of the link between nodes, in each direction, "
        "as tc writes it (e.g. 200mbit, 1gbit). Unset: not limited.",
    )
    flags.DEFINE_string(
        "inter_node_burst", netns.DEFAULT_BURST,
        "With --inter_node_rate: tbf burst (bucket size, e.g. 256kb = kilobytes).",
    )
    flags.DEFINE_string(
        "inter_node_latency", netns.DEFAULT_LATENCY,
        "With --inter_node_rate: tbf latency (longest a packet may queue).",
    )
    flags.DEFINE_integer(
        "max_restarts", 0,
        "When a worker fails (non-zero exit or killed), stop the others and "
        "relaunch all workers on fresh ports, up to this many times in the "
        "whole run. tfscale-train with --model_dir resumes from its newest "
        "checkpoint. 0: fail at once.",
        lower_bound=0,
    )
    flags.DEFINE_integer(
        "min_workers", None,
        "With --max_restarts: a worker slot that fails again within "
        "--restart_window seconds of a restart is dropped and the job goes on "
        "with one worker fewer, down to this many. Unset: --num_workers "
        "(never shrink).",
        lower_bound=1,
    )
    flags.DEFINE_float(
        "restart_window", restarts.DEFAULT_RESTART_WINDOW,
        "With --min_workers: seconds after a restart within which a slot that "
        "failed before and fails again is dropped.",
        lower_bound=0,
    )

    flags.DEFINE_integer(
        "gpus_per_node", None,
        "GPUs of each node: each worker gets exactly one through "
        "CUDA_VISIBLE_DEVICES, worker of local rank r GPU r (r-th entry of "
        "the launcher's CUDA_VISIBLE_DEVICES if set); one worker per GPU, so "
        "it must equal the workers per node (--num_workers, or --num_workers "
        "/ --emulate_nodes). A worker's GPU follows its slot across restarts. "
        "Unset: workers inherit the launcher's environment.",
        lower_bound=1,
    )
    flags.DEFINE_list(
        "preload", [],
        "Fork the workers from one process that has imported these Python "
        "modules (e.g. tensorflow,keras) instead of starting each afresh: each "
        "worker, at every launch and restart, is spared that import. The "
        "command must be Python run by this interpreter (python SCRIPT, python "
        "-m MODULE, or a console script such as tfscale-train). Linux only; "
        "see launch/preload.py. Unset: fresh processes.",
    )

    @flags.multi_flags_validator(["num_workers", "emulate_nodes", "gpus_per_node"])
    def _validate_gpu_flags(values):
        problem = gpus.check_gpus_per_node(**values)
        if problem:
            raise flags.ValidationError(problem)
        return True

    @flags.multi_flags_validator(
        ["num_workers", "emulate_nodes", "inter_node_rate", "inter_node_burst",
         "inter_node_latency"])
    def _validate_emulation_flags(values):
        problem = check_emulation_flags(**values)
        if problem:
            raise flags.ValidationError(problem)
        return True

    @flags.multi_flags_validator(
        ["num_workers", "max_restarts", "min_workers", "restart_window",
         "emulate_nodes"])
    def _validate_restart_flags(values):
        problem = check_restart_flags(**values)
        if problem:
            raise flags.ValidationError(problem)
        return True

    flag_help.list_in_help(__name__)


def check_emulation_flags(num_workers, emulate_nodes, inter_node_rate,
                          inter_node_burst, inter_node_latency):
    """The reason the emulation flags are inconsistent, or None."""
    if emulate_nodes is None:
        if (inter_node_rate is not None or inter_node_burst != netns.DEFAULT_BURST
                or inter_node_latency != netns.DEFAULT_LATENCY):
            return "--inter_node_rate/--inter_node_burst/--inter_node_latency need --emulate_nodes"
        return None
    if not 1 <= emulate_nodes <= netns.MAX_NODES:
        return (f"--emulate_nodes={emulate_nodes}: must be between 1 and "
                f"{netns.MAX_NODES} (the number of emulated nodes)")
    if num_workers % emulate_nodes:
        return (f"--num_workers={num_workers} is not divisible by "
                f"--emulate_nodes={emulate_nodes}: every emulated node runs the "
                "same number of workers")
    return None


def check_restart_flags(num_workers, max_restarts, min_workers, restart_window,
                        emulate_nodes):
    """The reason the restart flags are inconsistent, or None."""
    problem = restarts.check_restart_options(
        num_workers, max_restarts, min_workers, restart_window)
    if problem is None and emulate_nodes is not None and (
            min_workers is not None and min_workers < num_workers):
        problem = (f"--min_workers={min_workers} cannot be combined with "
                   "--emulate_nodes: every emulated node runs the same number "
                   "of workers, so none can be dropped; leave --min_workers "
                   "unset (restarts keep every worker)")
    return problem


ISOLATE_CHOICES = ("auto", "yes", "no")
_POLL_SECONDS = 0.1
PORT_ATTEMPTS = 3
# What a worker prints when its port was taken: TensorFlow's gRPC server
# ("Could not start gRPC server"), Python's OSError, or errno's name.
_BIND_FAILURE = re.compile(rb"Could not start gRPC server|Address already in use|EADDRINUSE")


class _PortTaken(Exception):
    """A worker could not bind its port; every worker has been stopped."""


def tf_configs(addresses):
    """One TF_CONFIG per worker for a cluster of `addresses` ("host:port")."""
    return [
        json.dumps({
            "cluster": {"worker": list(addresses)},
            "task": {"type": "worker", "index": index},
        })
        for index in range(len(addresses))
    ]


class Workers:
    """A group of worker processes, each in its own session (process group),
    so stopping a worker also stops whatever it started."""

    def __init__(self, command, envs, prefixes=None, namespaces=None,
                 preloaded=None):
        """Worker I runs `command` with `envs[I]`: as `prefixes[I]` +
        `command` (`ip netns exec NS` for a namespace), or forked from
        `preloaded` (a `preload.PreloadProcess`) into namespace
        `namespaces[I]` (None: this one)."""
        self._lock = threading.Lock()
        self.bind_failures = set()  # indices of workers that could not bind
        self.flight_positions = {}  # index: its flight recorder's last report
        self.processes = []
        self._printers = []
        target = preload.python_target(command) if preloaded is not None else None
        for index, env in enumerate(envs):
            if preloaded is not None:
                try:
                    process = preloaded.start(target, env,
                                              namespaces[index] if namespaces else None)
                except preload.PreloadError:
                    self.stop(grace_seconds=0)
                    raise
            else:
                prefix = list(prefixes[index]) if prefixes else []
                process = subprocess.Popen(
                    prefix + list(command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    # Even a launcher killed with SIGKILL leaves no orphans.
                    preexec_fn=preload.die_with_parent,
                )
            self.processes.append(process)
            printer = threading.Thread(
                target=self._print_lines, args=(index, process.stdout), daemon=True
            )
            printer.start()
            self._printers.append(printer)

    def _print_lines(self, index, stream):
        prefix = f"[worker {index}] ".encode()
        for line in iter(stream.readline, b""):
            if _BIND_FAILURE.search(line):
                self.bind_failures.add(index)
            position = flight_report.parse(line.decode(errors="replace"))
            if position is not None:
                self.flight_positions[index] = position
            with self._lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    def first_failure(self):
        """(index, returncode) of a failed worker, or None."""
        for index, process in enumerate(self.processes):
            code = process.poll()
            if code is not None and code != 0:
                return index, code
        return None

    def flight_summary(self):
        """Which worker is behind, from the workers' flight recorder reports
        (`tfscale.flight_report`), or None without reports."""
        if not self.flight_positions:
            return None
        finished = {i for i, p in enumerate(self.processes) if p.poll() == 0}
        return flight_report.summarize(self.flight_positions, len(self.processes),
                                         finished=finished)

    def wait(self, seconds):
        """Waits up to `seconds` for every worker to exit by itself."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(
                p.poll() is None for p in self.processes):
            time.sleep(_POLL_SECONDS)

    def all_succeeded(self):
        return all(p.poll() == 0 for p in self.processes)

    def stop(self, grace_seconds):
        """SIGTERM every live worker's process group, SIGKILL after grace."""
        for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 5)):
            for process in self.processes:
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, sig)
                    except ProcessLookupError:
                        pass
            self.wait(wait)
        # Workers are gone; reap what their process groups left behind too.
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for printer in self._printers:
            printer.join(timeout=5)


def launch(command, num_workers, timeout=0, grace_seconds=10, host="127.0.0.1",
           emulate_nodes=None, inter_node_rate=None,
           inter_node_burst=netns.DEFAULT_BURST,
           inter_node_latency=netns.DEFAULT_LATENCY, pick_ports=ports.free_ports,
           max_restarts=0, min_workers=None,
           restart_window=restarts.DEFAULT_RESTART_WINDOW, isolate="auto",
           gpus_per_node=None, preload_modules=()):
    """Runs `command` as `num_workers` workers; returns the exit code.

    `isolate` ("auto", "yes", "no"): whether the workers run in a network
    namespace of their own (see the module docstring). Not isolated, they use
    `host`: `pick_ports(host, count)` returns the ports of one attempt (default:
    `ports.free_ports`). When a worker fails and its output says it could not bind
    (`_BIND_FAILURE`), every worker is stopped and all are relaunched on
    newly picked ports, up to PORT_ATTEMPTS attempts per launch within
    `timeout`. Namespaces need no retry: their ports are theirs alone. Any
    other failure relaunches every worker on fresh ports
    up to `max_restarts` times, dropping slots down to `min_workers`
    (`launch.restarts.RestartPolicy`); `timeout` bounds the whole run.
    `gpus_per_node`: give each worker one GPU (launch/gpus.py).
    `preload_modules`: fork the workers from a process that imported these
    (launch/preload.py); empty: start each afresh.
    """
    if isolate not in ISOLATE_CHOICES:
        raise ValueError(f"isolate must be one of {ISOLATE_CHOICES}, got {isolate!r}")
    problem = check_restart_flags(num_workers, max_restarts, min_workers,
                                  restart_window, emulate_nodes)
    if problem is None:
        problem = gpus.check_gpus_per_node(num_workers, emulate_nodes, gpus_per_node)
    gpu_of_slot = None
    if problem is None and gpus_per_node is not None:
        try:
            devices = gpus.node_devices(
                gpus_per_node, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as error:
            problem = str(error)
        else:
            per_node = gpus.workers_per_node(num_workers, emulate_nodes)
            gpu_of_slot = functools.partial(
                gpus.gpu_for_slot, workers_per_node=per_node, devices=devices)
    if problem:
        print(f"tfscale-launch: {problem}", file=sys.stderr)
        return 2
    # Inside a namespace `ip netns exec` would only report a missing command
    # from each worker; say it once, before making anything.
    if shutil.which(command[0]) is None:
        return _command_not_found(command)
    if preload_modules:
        problem = _preload_problem(command)
        if problem:
            print(f"tfscale-launch: {problem}", file=sys.stderr)
            return 2
    policy = restarts.RestartPolicy(
        num_workers, max_restarts, min_workers, restart_window)
    share = threads.describe(num_workers)
    if share:
        print(share, flush=True)
    start = time.monotonic()
    if emulate_nodes is not None:
        return _launch_emulated(
            command, policy, timeout, grace_seconds, emulate_nodes,
            inter_node_rate, inter_node_burst, inter_node_latency, start,
            gpu_of_slot, preload_modules,
        )
    if isolate != "no":
        code = _launch_isolated(command, policy, timeout, grace_seconds, start,
                                required=isolate == "yes", gpu_of_slot=gpu_of_slot,
                                preload_modules=preload_modules)
        if code is not None:
            return code

    def launch_slots(slots, restart):
        for attempt in range(1, PORT_ATTEMPTS + 1):
            addresses = [f"{host}:{port}" for port in pick_ports(host, len(slots))]
            try:
                return _run_workers(
                    command, addresses, timeout, grace_seconds, start=start,
                    retry=attempt < PORT_ATTEMPTS, slots=slots, restart=restart,
                    gpu_of_slot=gpu_of_slot, preload_modules=preload_modules)
            except _PortTaken as taken:
                print(f"tfscale-launch: {taken}; stopped every worker, relaunching "
                      f"all on fresh ports (attempt {attempt + 1} of "
                      f"{PORT_ATTEMPTS}).", file=sys.stderr, flush=True)

    return _with_signals_as_interrupts(
        lambda: _supervise(policy, launch_slots, timeout, start))


def _preload_problem(command):
    """Why `command` cannot be forked from a preload process, or None."""
    if not sys.platform.startswith("linux"):
        return "--preload needs Linux (setns, PR_SET_CHILD_SUBREAPER)."
    if preload.python_target(command) is None:
        return (f"--preload forks Python workers: the command must be `python "
                f"SCRIPT`, `python -m MODULE` or a script whose #! line names this "
                f"Python ({sys.executable}); {command[0]!r} is none of these. Leave "
                "--preload unset to start it afresh.")
    return None


_preloaded = None  # this launcher's preload process, kept across launches


def _preload_process(modules, env):
    """A preload process of `modules` for workers of environment `env`: the
    one of earlier launches and restarts (sparing them the imports) unless
    it serves other modules or another environment."""
    global _preloaded
    if _preloaded is not None and _preloaded.serves(modules, env):
        return _preloaded
    if _preloaded is None:
        atexit.register(lambda: _preloaded.close())
    else:
        _preloaded.close()
    _preloaded = preload.PreloadProcess(modules, env)
    return _preloaded


def _command_not_found(command):
    print(f"tfscale-launch: command not found: {command[0]!r}", file=sys.stderr)
    return 127


def _raise_interrupt(signum, frame):
    """A SIGTERM handler: unwind as Ctrl-C does, stopping the workers."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _interrupted_code(interrupt):
    """128 + the signal's number, as shells report it: 130 for Ctrl-C, 143
    for SIGTERM (a preemption: the workers, sent SIGTERM in turn, saved the
    step they agreed on within --grace_seconds; `tfscale.preemption`)."""
    return 128 + (signal.SIGTERM if str(interrupt) == "SIGTERM" else signal.SIGINT)


def _with_signals_as_interrupts(run):
    """`run()` with SIGTERM raising KeyboardInterrupt, as Ctrl-C does; an
    interrupt between launches (no worker running) returns 130 (143 for
    SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run()
    except KeyboardInterrupt as interrupt:
        print(f"tfscale-launch: interrupted ({str(interrupt) or 'SIGINT'}); "
              "stopped every worker.", file=sys.stderr)
        return _interrupted_code(interrupt)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _supervise(policy, launch_slots, timeout, start):
    """Launches `policy.slots` until a launch ends without a worker failure or
    `policy` allows no restart; returns the exit code.

    `launch_slots(slots, restart)` runs one launch: an exit code, or a
    `restarts.WorkerFailure` after stopping every worker.
    """
    while True:
        if policy.restarts and timeout and time.monotonic() - start > timeout:
            print(f"tfscale-launch: timed out after {timeout:g} s; stopped every "
                  "worker.", file=sys.stderr)
            return 124
        outcome = launch_slots(list(policy.slots), policy.restarts)
        if not isinstance(outcome, restarts.WorkerFailure):
            return outcome
        decision = policy.after_failure(outcome)
        print(f"tfscale-launch: {decision.message}", file=sys.stderr, flush=True)
        if not decision.restart:
            return outcome.exit_code


def _launch_isolated(command, policy, timeout, grace_seconds, start, required,
                     gpu_of_slot=None, preload_modules=()):
    """`launch` in one network namespace, on 127.0.0.1 there; None where the
    namespace cannot be made and isolation is not `required` (the caller then
    launches on this machine's network, after the message printed here)."""
    num_workers = len(policy.slots)
    cluster = netns.EmulatedCluster(num_nodes=1, workers_per_node=num_workers)
    prefix = cluster.workers[0].prefix

    def launch_slots(slots, restart):
        # Fewer workers once a slot is dropped; each restart on ports no
        # earlier launch of this run used.
        return _run_workers(
            command, [f"127.0.0.1:{_launch_port(i, restart, num_workers)}"
                      for i in range(len(slots))],
            timeout, grace_seconds, start=start, prefixes=[prefix] * len(slots),
            namespaces=[cluster.nodes[0]] * len(slots), slots=slots,
            restart=restart, gpu_of_slot=gpu_of_slot, preload_modules=preload_modules,
        )

    announce = (f"workers isolated in network namespace {cluster.nodes[0]}: "
                "nothing outside it can reach their ports, and they cannot "
                "reach the network (--isolate=no if they must).")
    try:
        return _supervise_in(cluster, announce, policy, launch_slots, timeout, start)
    except netns.EmulationError as error:
        reason = str(error).rstrip(".")
        if required:
            print(f"tfscale-launch: cannot isolate the workers: {reason}. Run as "
                  "root with iproute2, or pass --isolate=no.", file=sys.stderr)
            return 2
        print(f"tfscale-launch: workers listen on all interfaces of this machine, "
              f"unauthenticated (not isolated: {reason}); run on a trusted network "
              "only (docs/security.md).", file=sys.stderr, flush=True)
        return None


def _launch_emulated(command, policy, timeout, grace_seconds, num_nodes,
                     rate, burst, latency, start, gpu_of_slot=None,
                     preload_modules=()):
    """`launch` with the workers in emulated nodes (launch/netns.py)."""
    num_workers = len(policy.slots)
    problem = check_emulation_flags(num_workers, num_nodes, rate, burst, latency)
    if problem:
        print(f"tfscale-launch: {problem}", file=sys.stderr)
        return 2
    cluster = netns.EmulatedCluster(
        num_nodes, num_workers // num_nodes, rate, burst, latency)

    def launch_slots(slots, restart):
        # The same namespaces; each restart on ports no earlier launch of
        # this run has used.
        return _run_workers(
            command, [f"{w.host}:{_launch_port(w.index, restart, num_workers)}"
                      for w in cluster.workers],
            timeout, grace_seconds, start=start,
            prefixes=[w.prefix for w in cluster.workers],
            namespaces=[w.netns for w in cluster.workers],
            slots=slots, restart=restart, gpu_of_slot=gpu_of_slot,
            preload_modules=preload_modules,
        )

    try:
        return _supervise_in(cluster, cluster.describe(), policy, launch_slots,
                             timeout, start)
    except netns.LinkSettingsError as error:
        reason = str(error).rstrip(".")
        print(
            f"tfscale-launch: cannot rate-limit the inter-node link: {reason}. "
            "Check --inter_node_rate, --inter_node_burst and --inter_node_latency.",
            file=sys.stderr,
        )
        return 2
    except netns.EmulationError as error:
        reason = str(error).rstrip(".")
        print(
            f"tfscale-launch: cannot emulate nodes: {reason}. Run without "
            "--emulate_nodes to launch every worker on 127.0.0.1.",
            file=sys.stderr,
        )
        return 2


def _supervise_in(cluster, announce, policy, launch_slots, timeout, start):
    """`_supervise` with the workers in `cluster`'s namespaces (a
    `netns.EmulatedCluster`), printing `announce` once they exist. Raises
    `netns.EmulationError` when the namespaces cannot be made (no worker has
    started then)."""
    # Installed before the namespaces exist, so that SIGTERM at any point
    # unwinds through EmulatedCluster.__exit__ instead of killing us mid-way.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with cluster:
            if cluster.stale_removed:
                print("tfscale-launch: removed network namespaces left by a dead "
                      f"launcher: {' '.join(cluster.stale_removed)}", file=sys.stderr)
            print(f"tfscale-launch: {announce}", file=sys.stderr, flush=True)
            return _supervise(policy, launch_slots, timeout, start)
    except KeyboardInterrupt as interrupt:  # while making or removing namespaces
        print(f"tfscale-launch: interrupted ({str(interrupt) or 'SIGINT'}); "
              "no network namespace is left.", file=sys.stderr)
        return _interrupted_code(interrupt)
    finally:
        signal.signal(signal.SIGTERM, previous)


# Workers in namespaces listen on netns.BASE_PORT and up, below the ephemeral
# range.
_NAMESPACE_PORT_SPAN = 32768 - netns.BASE_PORT


def _launch_port(index, restart, num_workers):
    """Worker `index`'s port in launch number `restart` inside namespaces:
    shifted by `restart * num_workers`, wrapping within the range below the
    ephemeral ports (so a port is reused only thousands of launches later)."""
    offset = index + restart * num_workers
    return netns.BASE_PORT + offset % _NAMESPACE_PORT_SPAN


def started_line(restart, slots, pids, addresses):
    """The line naming each worker's slot, pid and address once launch
    `restart` has started them: for `kill`, `py-spy dump --pid` or a
    debugger, and to tell a forked worker's slot, which its /proc/PID/environ
    (its preload process's) cannot."""
    started = ", ".join(
        f"worker {index} (slot {slot}) pid {pid} at {address}"
        for index, (slot, pid, address) in enumerate(
            zip(slots, pids, addresses, strict=True)))
    return f"launch {restart} started {started}."


def _run_workers(command, addresses, timeout, grace_seconds, prefixes=None,
                 start=None, retry=False, slots=None, restart=0, gpu_of_slot=None,
                 namespaces=None, preload_modules=()):
    """Runs one worker per address until all succeed, one fails or time is up
    (`timeout` counted from `start`, default now).

    Worker I gets slot `slots[I]` (default I) and `restart` in its
    environment, and CUDA_VISIBLE_DEVICES=`gpu_of_slot(slots[I])` if given. It
    runs as `prefixes[I]` + `command`, or forked into `namespaces[I]` from a
    process that imported `preload_modules` when given. Returns an exit code, or a `restarts.WorkerFailure` when a
    worker failed (every worker is stopped by then). With `retry`, raises
    _PortTaken instead when a worker could not bind its port.
    """
    slots = list(range(len(addresses))) if slots is None else slots
    envs = []
    share = threads.worker_environment(len(addresses))
    for config, slot in zip(tf_configs(addresses), slots, strict=True):
        envs.append(dict(os.environ, TF_CONFIG=config, PYTHONUNBUFFERED="1",
                         TFSCALE_SLOT=str(slot),
                         TFSCALE_RESTART_COUNT=str(restart), **share))
        if gpu_of_slot is not None:
            envs[-1]["CUDA_VISIBLE_DEVICES"] = gpu_of_slot(slot)
    try:
        preloaded = (_preload_process(preload_modules, envs[0])
                     if preload_modules else None)
        workers = Workers(command, envs, prefixes, namespaces, preloaded)
    except FileNotFoundError:
        return _command_not_found(command)
    except preload.PreloadError as error:
        print(f"tfscale-launch: {error}.", file=sys.stderr, flush=True)
        return 2
    pids = [process.pid for process in workers.processes]
    print(f"tfscale-launch: {started_line(restart, slots, pids, addresses)}",
          file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    launched = time.monotonic()
    start = launched if start is None else start
    try:
        while True:
            failure = workers.first_failure()
            if failure is not None:
                index, code = failure
                seconds = time.monotonic() - launched
                if code == restarts.PREEMPTED_EXIT_CODE:
                    # The others saved the same step and are leaving too.
                    workers.wait(grace_seconds)
                workers.stop(grace_seconds)  # also reads the rest of their output
                summary = workers.flight_summary()
                if summary:
                    print(f"tfscale-launch: flight recorder: {summary}.",
                          file=sys.stderr, flush=True)
                if retry and workers.bind_failures:
                    index = min(workers.bind_failures)
                    raise _PortTaken(f"worker {index} could not bind {addresses[index]}")
                return restarts.WorkerFailure(index, slots[index], code, seconds)
            if workers.all_succeeded():
                workers.stop(grace_seconds)  # joins the output threads
                return 0
            if timeout and time.monotonic() - start > timeout:
                workers.stop(grace_seconds)
                print(
                    f"tfscale-launch: timed out after {timeout:g} s; "
                    "stopped every worker.",
                    file=sys.stderr,
                )
                return 124
            time.sleep(_POLL_SECONDS)
    except KeyboardInterrupt as interrupt:
        workers.stop(grace_seconds)
        print(
            f"tfscale-launch: interrupted ({str(interrupt) or 'SIGINT'}); "
            "stopped every worker.",
            file=sys.stderr,
        )
        return _interrupted_code(interrupt)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv):
    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        sys.exit("tfscale-launch: no command given. Usage: tfscale-launch "
                 "--num_workers=N -- CMD [ARGS...], e.g. tfscale-launch "
                 "--num_workers=2 -- tfscale-train")
    sys.exit(
        launch(
            command,
            FLAGS.num_workers,
            timeout=FLAGS.timeout,
            grace_seconds=FLAGS.grace_seconds,
            emulate_nodes=FLAGS.emulate_nodes,
            inter_node_rate=FLAGS.inter_node_rate,
            inter_node_burst=FLAGS.inter_node_burst,
            inter_node_latency=FLAGS.inter_node_latency,
            max_restarts=FLAGS.max_restarts,
            min_workers=FLAGS.min_workers,
            restart_window=FLAGS.restart_window,
            isolate=FLAGS.isolate,
            gpus_per_node=FLAGS.gpus_per_node,
            preload_modules=FLAGS.preload,
        )
    )


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
