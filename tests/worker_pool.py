"""Reused worker processes for the multi-worker tests.

A `WorkerPool` of N is N Python processes (tests/pool_worker.py) on
127.0.0.1, each with its TF_CONFIG, started once and kept: every scenario
(a script of tests/workers/) runs in all N, which build their own strategy,
data and model and talk through TensorFlow's runtime as any tfscale job does.
What a scenario saves is the start-up: interpreters, TensorFlow's import,
the cluster's first connection. TensorFlow's distribute tests do the same
(`MultiProcessPoolRunner`, tensorflow/python/distribute/multi_process_runner.py).

The pools' workers are forked from one process per pytest process that
imported tfscale's core once (`tfscale-launch --preload`'s preload process,
launch/preload.py), as TensorFlow's runner starts its processes from a
multiprocessing forkserver (`AbslForkServerContext`,
tensorflow/python/distribute/multi_process_lib.py): a pool replaced, or
started for another size, pays no import. Each worker talks to its pool
over a Unix socket: requests in, one status line per scenario out.

A scenario that fails, hangs past its timeout or leaves state behind ends
its pool: the test sees every worker's output, and the next scenario of that
size starts a new pool.
"""

import itertools
import json
import os
import select
import shutil
import signal
import socket
import tempfile
import time

from tfscale.launch import preload

HERE = os.path.dirname(os.path.abspath(__file__))

# Pools kept at once: one for each worker count the suite uses (1 to 5); a
# size asked for beyond that ends the least recently used one.
MAX_POOLS = 5
# What the kept pools' workers may hold of their own (Private_Dirty in
# /proc/PID/smaps_rollup, beside TensorFlow's libraries and the heap of its
# import, which all of them share with the preload process). A worker holds
# ~10 MB after a small scenario, but one that ran a large batch keeps its
# peak, 3-4 GB in a full run: its CPU
# allocator is a BFC allocator (TF_CPU_ALLOCATOR_USE_BFC, conftest.py),
# which keeps large blocks for reuse. Beyond this, the least
# recently used pools end (or the one asked for, if it alone holds that
# much), which leaves room for the pytest process (~2 GB) and
# test_scale.py's 9 fresh workers (~7 GB) on a 24 GB machine. Under
# pytest-xdist each pytest process keeps pools of its own: they share it.
MAX_POOLS_MEMORY_BYTES = (8 << 30) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))

# What the preload process imports: what a pool worker imports first.
PRELOADED = ("tfscale.strategy",)
# How long a new worker may take to connect to its pool.
CONNECT_SECONDS = 120

_pools = {}  # num_workers -> WorkerPool, least recently used first
_preloaded = [None]  # the preload process the pools' workers are forked from
_scenario_ids = itertools.count()


def _preload_process(env):
    """The preload process for workers of environment `env` (started anew
    when it has ended or `env` differs from what it imported with)."""
    current = _preloaded[0]
    if current is None or not current.serves(PRELOADED, env):
        if current is not None:
            current.close()
        _preloaded[0] = preload.PreloadProcess(PRELOADED, env)
    return _preloaded[0]


def fork(target, env, import_env, output=None, cwd=None):
    """Forks a process of a test's own running `target` (see
    `preload.python_target`) with environment `env`, from the preload
    process for `import_env` (`env` less what the process reads only at run
    time): the one the pools' workers come from, where that is theirs.
    Returns a `preload.ForkedWorker`, the pytest process its parent."""
    return _preload_process(import_env).start(target, env, output=output, cwd=cwd)


class WorkerPool:
    """N reused worker processes forming one cluster."""

    def __init__(self, num_workers, env):
        from multiworker import cluster_tf_configs

        self.num_workers = num_workers
        self.directory = tempfile.mkdtemp(prefix=f"tfscale-pool-{num_workers}-")
        self.processes, self.logs = [], []
        address = os.path.join(self.directory, "pool.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(num_workers)
        preloaded = _preload_process(env)
        configs = cluster_tf_configs([("worker", i) for i in range(num_workers)])
        try:
            for index, config in enumerate(configs):
                log_path = os.path.join(self.directory, f"worker-{index}.log")
                with open(log_path, "wb") as log:
                    self.processes.append(preloaded.start(
                        ("script", os.path.join(HERE, "pool_worker.py"), [address]),
                        dict(env, TF_CONFIG=config, TFSCALE_SLOT=str(index),
                             TFSCALE_RESTART_COUNT="0"),
                        output=log, cwd=self.directory))
                self.logs.append(log_path)
            self._channels = self._connect(listener)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self._status = [channel.makefile("r") for channel in self._channels]

    def _connect(self, listener):
        """Each worker's connection, by worker index (each names itself first)."""
        channels = [None] * self.num_workers
        deadline = time.monotonic() + CONNECT_SECONDS
        listener.settimeout(1.0)
        while None in channels:
            try:
                channel, _ = listener.accept()
            except socket.timeout:
                dead = [i for i, p in enumerate(self.processes) if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"worker pool of {self.num_workers}: workers {dead or 'all'} "
                        f"did not start:\n{self._output([0] * self.num_workers)[-6000:]}")
                continue
            channel.settimeout(CONNECT_SECONDS)
            index = int(channel.makefile("r").readline())
            channel.settimeout(None)
            channels[index] = channel
        return channels

    def alive(self):
        return all(p.poll() is None for p in self.processes)

    def own_memory_bytes(self):
        """What this pool's workers hold of their own (not shared pages)."""
        total = 0
        for process in self.processes:
            try:
                with open(f"/proc/{process.pid}/smaps_rollup") as rollup:
                    total += 1024 * next(int(line.split()[1]) for line in rollup
                                         if line.startswith("Private_Dirty:"))
            except (OSError, StopIteration):  # gone: alive() says so
                pass
        return total

    def run(self, target, args, cwd, env, timeout):
        """Runs `target` (`{"script": path}` or `{"module": name}`) with
        `args` on every worker.

        Returns (exit codes, output, why): an exit code is None where the
        worker had not finished when the pool stopped waiting; `why` says
        why it stopped (None when every worker finished). When any worker
        failed, died or time ran out, the pool is closed: a peer of a failed
        worker may wait in a collective for ever.
        """
        scenario = next(_scenario_ids)
        offsets = [os.path.getsize(path) for path in self.logs]
        request = json.dumps({"id": scenario, **target, "args": list(args),
                              "env": env, "cwd": str(cwd)}) + "\n"
        for channel in self._channels:
            channel.sendall(request.encode())
        codes, why = self._wait(scenario, time.monotonic() + timeout, timeout)
        output = self._output(offsets)
        if why is not None:
            self.close()
        return codes, output, why

    def _wait(self, scenario, deadline, timeout):
        codes = [None] * self.num_workers
        waiting = {pipe: index for index, pipe in enumerate(self._status)}
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                return codes, f"workers {sorted(waiting.values())} did not finish within {timeout} s"
            for pipe in ready:
                index = waiting.pop(pipe)
                line = pipe.readline()
                if not line:
                    return codes, f"worker {index} died (exit status {self.processes[index].wait()})"
                status = json.loads(line)
                assert status["id"] == scenario, (status, scenario)
                codes[index] = status["exit"]
                if codes[index] != 0:  # the others may wait for it for ever
                    return codes, f"worker {index} failed (exit status {codes[index]})"
        return codes, None

    def _output(self, offsets):
        """Each worker's output since `offsets`, its lines prefixed with the
        worker's index as tfscale-launch prefixes them."""
        lines = []
        for index, (path, offset) in enumerate(zip(self.logs, offsets, strict=True)):
            with open(path, "rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
            lines += [f"[worker {index}] {line}" for line in text.splitlines()]
        return "\n".join(lines) + "\n"

    def close(self):
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process.wait()
        for end in getattr(self, "_status", []) + getattr(self, "_channels", []):
            end.close()
        shutil.rmtree(self.directory, ignore_errors=True)  # the tests have the output
        if _pools.get(self.num_workers) is self:
            del _pools[self.num_workers]


def pool(num_workers, env):
    """The live pool of `num_workers`, started if there is none."""
    existing = _pools.pop(num_workers, None)
    own = 0 if existing is None else existing.own_memory_bytes()
    if existing is not None and (not existing.alive() or own > MAX_POOLS_MEMORY_BYTES):
        existing.close()
        existing, own = None, 0
    memory = {size: kept.own_memory_bytes() for size, kept in _pools.items()}
    while _pools and (len(_pools) >= MAX_POOLS
                      or own + sum(memory.values()) > MAX_POOLS_MEMORY_BYTES):
        oldest = next(iter(_pools))
        _pools[oldest].close()
        del memory[oldest]
    if existing is None:
        existing = WorkerPool(num_workers, env)
    _pools[num_workers] = existing  # now the most recently used
    return existing


def kept():
    """`{num_workers: WorkerPool}` of the pools kept, least recently used first."""
    return dict(_pools)


def close_all():
    for worker_pool in list(_pools.values()):
        worker_pool.close()
    if _preloaded[0] is not None:
        _preloaded[0].close()
        _preloaded[0] = None
