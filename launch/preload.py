"""Workers forked from a process that imported TensorFlow once:
`tfscale-launch --preload=MODULES`.

A fresh worker imports TensorFlow, Keras and the user's libraries anew:
seconds of CPU per worker, paid again at every restart. With `--preload`
the launcher starts one preload process, which imports MODULES (for a
TensorFlow worker: `--preload=tensorflow,keras`, or `tfscale.strategy` for
tfscale's core too) and then forks one worker per request, as gunicorn's
`--preload` does for web workers and Python's multiprocessing forkserver
(`set_forkserver_preload`) for its processes. Importing does not start
TensorFlow's runtime (no device, thread pool or gRPC server exists before
a worker makes one), so each worker starts its own after the fork, with
its own TF_CONFIG, thread share and CUDA_VISIBLE_DEVICES.

What stays as for a fresh worker:
- the launcher is each worker's parent: the preload process forks a
  child that forks the worker and exits, and the launcher, a child
  subreaper (PR_SET_CHILD_SUBREAPER, Linux 3.4), adopts the worker; it
  waits for it and reads its exit status (-N when killed by signal N) as
  for a process it started itself;
- each worker leads a session of its own (`killpg` stops what it started)
  and is SIGKILLed when the launcher dies (PR_SET_PDEATHSIG, set once the
  launcher has adopted it);
- its environment, working directory, argv, sys.path[0] and output pipe are
  the ones a fresh `python SCRIPT` or `python -m MODULE` would get; it enters
  its network namespace (isolation, emulated nodes) with setns(2).
What differs: /proc/PID/environ and /proc/PID/cmdline (what `ps` shows)
are the preload process's; the worker's own environment is `os.environ`.

The preload process is started with the workers' environment less the
variables set per worker (PER_WORKER): the others, read at import, are
the workers' own. Linux only (setns, subreapers).

A process that has imported MODULES already, and started no TensorFlow
runtime, can hand a launcher it runs in-process a preload process forked
from itself (`hand_down`): a test harness whose processes are forked from
a preload process of its own, as tfscale's suite is (tests/README.md).
"""

import ctypes
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from tfscale.launch import garbage_collection

# Set by the launcher for each worker (launch/local.py); TensorFlow reads
# them when a worker builds its runtime, after the fork, not at import.
PER_WORKER = ("TF_CONFIG", "TFSCALE_SLOT", "TFSCALE_RESTART_COUNT",
              "CUDA_VISIBLE_DEVICES", "TF_NUM_INTRAOP_THREADS",
              "TF_NUM_INTEROP_THREADS")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"  # where `ip netns add` mounts a namespace
_MAX_REQUEST = 1 << 20  # bytes; a request is mostly the worker's environment


class PreloadError(RuntimeError):
    """The preload process could not start a worker."""


def python_target(command):
    """What `command` runs in this interpreter: ("module", NAME, ARGS) for
    `python -m NAME ARGS`, ("script", PATH, ARGS) for `python PATH ARGS` or
    a script whose #! line names this interpreter (a console script such as
    tfscale-train); None for anything else, which `--preload` cannot fork."""
    this_python = os.path.realpath(sys.executable)
    # A console script of this Python sits beside it, where a version
    # manager's shim on PATH (pyenv) would lead too.
    beside = os.path.join(os.path.dirname(sys.executable), command[0])
    executable = (beside if os.sep not in command[0] and os.path.isfile(beside)
                  else shutil.which(command[0]))
    if executable is None:
        return None
    if os.path.realpath(executable) == this_python:
        if len(command) >= 3 and command[1] == "-m":
            return ("module", command[2], list(command[3:]))
        if len(command) >= 2 and not command[1].startswith("-"):
            return ("script", os.path.abspath(command[1]), list(command[2:]))
        return None
    try:
        with open(executable, "rb") as f:
            first_line = f.readline(4096)
    except OSError:
        return None
    words = first_line[2:].decode(errors="replace").split()
    if words[:1] and os.path.basename(words[0]) == "env":  # #!/usr/bin/env python
        words = [shutil.which(words[1]) or ""] if len(words) > 1 else []
    if (first_line.startswith(b"#!") and words
            and os.path.realpath(words[0]) == this_python):
        return ("script", executable, list(command[1:]))
    return None


class PreloadProcess:
    """The launcher's end: starts the preload process (or takes the one
    `hand_down` forked, where it serves `modules` and `env`), then one
    worker per `start` call, each the launcher's own child."""

    def __init__(self, modules, env):
        self.modules = tuple(modules)
        self.env = _import_env(env)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
        self._printer = None
        handed_down = _take_handed_down(self.modules, self.env)
        if handed_down is not None:
            self._socket, self._process = handed_down
            return
        # One request or reply per packet (SOCK_SEQPACKET keeps their bounds).
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tfscale.launch.preload", str(theirs.fileno()),
             ",".join(self.modules)],
            env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, pass_fds=[theirs.fileno()],
            start_new_session=True, preexec_fn=die_with_parent,
        )
        theirs.close()
        # What importing prints (TensorFlow's start-up lines, an ImportError),
        # prefixed as the workers' lines are.
        self._printer = threading.Thread(target=_print_prefixed,
                                         args=(self._process.stdout,), daemon=True)
        self._printer.start()

    def serves(self, modules, env):
        """Whether workers of `modules` with environment `env` can be forked
        from this process (same modules, same environment at import)."""
        return (self._process.poll() is None and tuple(modules) == self.modules
                and _import_env(env) == self.env)

    def start(self, target, env, netns=None, output=None, cwd=None):
        """Forks a worker running `target` (see `python_target`) with
        environment `env`, in network namespace `netns` (a name from `ip
        netns`) if given, in folder `cwd` (default: this process's); returns
        it as a `ForkedWorker`. Its standard output and error go to a pipe,
        its `stdout`, or to the open file `output` (as
        `subprocess.Popen(stdout=output, stderr=STDOUT)`)."""
        if output is None:
            read, write = os.pipe()
        else:
            read, write = None, os.dup(output.fileno())
        request = {"target": target, "env": env, "cwd": cwd or os.getcwd(),
                   "netns": netns, "parent": os.getpid()}
        try:
            socket.send_fds(self._socket, [json.dumps(request).encode()], [write])
            reply = self._socket.recv(4096)
        except OSError:
            reply = b""
        finally:
            os.close(write)
        if not reply:
            if read is not None:
                os.close(read)
            code = self._process.wait()
            if self._printer is not None:
                self._printer.join(timeout=10)
            raise PreloadError(
                f"the preload process (--preload={','.join(self.modules)}) exited "
                f"with code {code} before starting a worker; its output is above, "
                "prefixed [preload]")
        return ForkedWorker(json.loads(reply)["pid"],
                            None if read is None else os.fdopen(read, "rb"))

    def close(self):
        self._socket.close()  # the preload process exits at end of input
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _import_env(env):
    """What of a worker's environment its preload process imports with."""
    return {k: v for k, v in env.items() if k not in PER_WORKER}


# (channel, child, modules, environment) from `hand_down`, until a launcher
# takes it.
_handed_down = []


def hand_down(modules):
    """Forks this process into a preload process of `modules` for the
    launcher this process goes on to run in-process (`tfscale.launch.local`
    or `tfscale.launch.bench` by `runpy`): its first `PreloadProcess` of
    `modules` for this environment is that child, not a new interpreter
    importing them again. This process must have imported `modules` and run
    nothing else on other threads (no TensorFlow runtime, which starts
    them): forking is then as safe as the preload process's own."""
    problems = []
    missing = [m for m in modules if m not in sys.modules]
    if missing:
        problems.append(f"{missing} not imported")
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        problems.append(f"{threads} threads running")
    if problems:
        raise PreloadError(
            f"hand_down({','.join(modules)}) forks a process that imported them and "
            f"runs one thread: {'; '.join(problems)}")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        ours.close()
        os.setsid()  # as `start_new_session` puts a new preload process
        die_with_parent()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        request = _serve(theirs, os.pipe())
        if request is None:
            os._exit(0)  # the launcher's code after the fork is not ours to run
        run_target(_become_worker(request))
        sys.exit(0)
    theirs.close()
    _handed_down[:] = [(ours, ForkedWorker(child, None), tuple(modules),
                        _import_env(os.environ))]


def _take_handed_down(modules, env):
    """(channel, process) of the handed-down preload process if it serves
    `modules` and `env` (a `PreloadProcess`'s), else None. One that does not
    is ended: the launcher then starts its own."""
    if not _handed_down:
        return None
    (channel, child, its_modules, its_env), = _handed_down
    _handed_down.clear()
    if its_modules == modules and its_env == env:
        return channel, child
    channel.close()  # the child exits at end of input
    child.wait()
    return None


class ForkedWorker:
    """A worker forked by the preload process and adopted by the launcher:
    `pid`, `stdout`, `poll()`, `wait()` and `kill()` as a `subprocess.Popen`
    has them."""

    def __init__(self, pid, stdout):
        self.pid = pid
        self.stdout = stdout
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        if timeout is None:
            if self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _print_prefixed(stream):
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(b"[preload] " + line)
        sys.stdout.buffer.flush()


def die_with_parent():
    """SIGKILLs this process when its parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _serve(channel, pid_pipe):
    """Forks a worker per request until the launcher closes `channel`;
    returns the request in each worker (and only there)."""
    while True:
        message, fds, _, _ = socket.recv_fds(channel, _MAX_REQUEST, 1)
        if not message:
            return None
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        middle = os.fork()
        if middle == 0:
            request["middle"] = os.getpid()
            worker = os.fork()
            if worker == 0:
                os.close(pid_pipe[0])
                os.close(pid_pipe[1])
                channel.close()
                request["stdout"] = fds[0]
                return request
            os.write(pid_pipe[1], f"{worker}\n".encode())
            os._exit(0)  # the worker is orphaned to the launcher, its subreaper
        os.close(fds[0])
        os.waitpid(middle, 0)
        worker = int(os.read(pid_pipe[0], 64))
        channel.send(json.dumps({"pid": worker}).encode())


def _become_worker(request):
    """Turns this forked process into the worker `request` describes, as far
    as a fresh process would see it; returns its target."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    while os.getppid() == request["middle"]:  # adopted once it has exited
        time.sleep(0.001)
    die_with_parent()
    if os.getppid() != request["parent"]:
        os._exit(1)  # it died before we asked to follow it
    if request["netns"]:
        with open(os.path.join(_NETNS_DIR, request["netns"])) as namespace:
            if libc.setns(namespace.fileno(), _CLONE_NEWNET) != 0:
                error = ctypes.get_errno()
                os.write(request["stdout"], f"cannot enter network namespace "
                         f"{request['netns']}: {os.strerror(error)}\n".encode())
                os._exit(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(request["stdout"], 1)
    os.dup2(request["stdout"], 2)
    os.close(devnull)
    os.close(request["stdout"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    return request["target"]


def run_target(target):
    """Runs `target` as `python -m NAME` or `python PATH` would."""
    kind, name, args = target
    if kind == "module":
        sys.argv = [name, *args]  # argv[0] becomes the module's file
        sys.path[0] = os.getcwd()
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [name, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(name))
        runpy.run_path(name, run_name="__main__")


# `python -m tfscale.launch.preload measure [ROUNDS [WORKERS]]`: one launch
# of tfscale-train (two steps, no export) on WORKERS workers (default 2),
# fresh and with --preload=tfscale.strategy in turn, ROUNDS times (default 3).
_MEASURED_TRAIN = ["tfscale-train", "--epochs=1", "--steps_per_epoch=2", "--export_dir="]


def measure(rounds=3, num_workers=2):
    """Prints the CPU-seconds (user + system, of every process of the
    launch) and wall seconds of each way, their medians, and the ratio."""
    import resource
    import statistics

    seen = {"fresh": [], "preload": []}
    for round_ in range(1, rounds + 1):
        for way, flag in (("fresh", []), ("preload", ["--preload=tfscale.strategy"])):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "tfscale.launch.local",
                 f"--num_workers={num_workers}", *flag, "--", *_MEASURED_TRAIN],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode != 0:
                sys.exit(f"the {way} launch failed:\n{done.stderr[-3000:]}")
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            seen[way].append((cpu, wall))
            print(f"round {round_} {way:8s} {cpu:6.1f} CPU-s {wall:6.1f} s", flush=True)
    fresh, preloaded = (statistics.median(c for c, _ in seen[w]) for w in seen)
    print(f"median CPU-s of a {num_workers}-worker launch: fresh {fresh:.1f}, "
          f"preload {preloaded:.1f}; "
          f"preload/fresh {preloaded / fresh:.2f}")


def main():
    if sys.argv[1:2] == ["measure"]:
        counts = sys.argv[2:]
        if len(counts) > 2 or not all(c.isdigit() and int(c) >= 1 for c in counts):
            sys.exit("usage: python -m tfscale.launch.preload measure [ROUNDS "
                     f"[WORKERS]], each a whole number from 1; got {counts}")
        measure(*(int(count) for count in counts))
        return
    channel = socket.socket(fileno=int(sys.argv[1]))
    modules = [m for m in sys.argv[2].split(",") if m]
    # Imported as a tfscale-train worker imports: collector paused, then
    # the heap frozen (launch/garbage_collection.py).
    if modules:
        garbage_collection.import_frozen(*modules)
    sys.argv = sys.argv[:1]
    request = _serve(channel, os.pipe())
    if request is None:
        return
    run_target(_become_worker(request))


if __name__ == "__main__":
    main()
