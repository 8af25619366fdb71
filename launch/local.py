r"""tfscale-launch: runs N workers of a command on this machine.

    tfscale-launch --num_workers=2 -- tfscale-train --epochs=3

Each worker is one process with its own TF_CONFIG naming a free 127.0.0.1
port for every worker, as Kubernetes or SLURM would give one per machine. Each
output line is prefixed with the worker's index. When a worker fails, the
others are stopped and the launcher exits non-zero naming the failed worker;
`--timeout` bounds the whole run.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

flags.DEFINE_integer("num_workers", 2, "Number of worker processes.", lower_bound=1)
flags.DEFINE_float(
    "timeout", 0, "Stop every worker and fail after this many seconds; 0: no limit."
)
flags.DEFINE_float(
    "grace_seconds", 10,
    "When stopping workers: seconds between SIGTERM and SIGKILL.",
)
FLAGS = flags.FLAGS

_POLL_SECONDS = 0.1


def free_ports(host, count):
    """`count` distinct ports on `host` that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_configs(addresses):
    """One TF_CONFIG per worker for a cluster of `addresses` ("host:port")."""
    return [
        json.dumps({
            "cluster": {"worker": list(addresses)},
            "task": {"type": "worker", "index": index},
        })
        for index in range(len(addresses))
    ]


def _describe_exit(returncode):
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class Workers:
    """A group of worker processes, each in its own session (process group),
    so stopping a worker also stops whatever it started."""

    def __init__(self, command, envs):
        self._lock = threading.Lock()
        self.processes = []
        self._printers = []
        for index, env in enumerate(envs):
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
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

    def all_succeeded(self):
        return all(p.poll() == 0 for p in self.processes)

    def stop(self, grace_seconds):
        """SIGTERM every live worker's process group, SIGKILL after grace."""
        for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 5)):
            live = [p for p in self.processes if p.poll() is None]
            for process in live:
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(
                p.poll() is None for p in live
            ):
                time.sleep(_POLL_SECONDS)
        # Workers are gone; reap what their process groups left behind too.
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for printer in self._printers:
            printer.join(timeout=5)


def launch(command, num_workers, timeout=0, grace_seconds=10, host="127.0.0.1"):
    """Runs `command` as `num_workers` workers; returns the exit code."""
    addresses = [f"{host}:{port}" for port in free_ports(host, num_workers)]
    envs = []
    for config in tf_configs(addresses):
        env = dict(os.environ, TF_CONFIG=config, PYTHONUNBUFFERED="1")
        envs.append(env)
    try:
        workers = Workers(command, envs)
    except FileNotFoundError:
        print(f"tfscale-launch: command not found: {command[0]!r}", file=sys.stderr)
        return 127

    def on_signal(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, on_signal)
    start = time.monotonic()
    try:
        while True:
            failure = workers.first_failure()
            if failure is not None:
                index, code = failure
                workers.stop(grace_seconds)
                print(
                    f"tfscale-launch: worker {index} {_describe_exit(code)}; "
                    f"stopped the other workers.",
                    file=sys.stderr,
                )
                return code if code > 0 else 1
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
            f"tfscale-launch: interrupted ({interrupt or 'SIGINT'}); "
            "stopped every worker.",
            file=sys.stderr,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv):
    command = argv[1:]
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise app.UsageError(
            "No command given. Usage: tfscale-launch --num_workers=N -- "
            "CMD [ARGS...], e.g. tfscale-launch --num_workers=2 -- tfscale-train"
        )
    sys.exit(
        launch(
            command,
            FLAGS.num_workers,
            timeout=FLAGS.timeout,
            grace_seconds=FLAGS.grace_seconds,
        )
    )


def run():
    app.run(main)


if __name__ == "__main__":
    run()
