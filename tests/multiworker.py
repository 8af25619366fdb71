"""Runs real worker processes on 127.0.0.1 for the multi-worker tests.

A worker script (tests/workers/*.py) runs on N workers, each with its own
TF_CONFIG: in a reused pool of worker processes (`run_workers`) or in N
fresh ones started by `tfscale-launch` (`launch_workers`). Each worker writes
what the test checks as JSON with `report(...)` (tests/workers/report.py).
"""

import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import worker_pool
from tfscale.launch import preload
from tfscale.launch import threads

WORKERS_DIR = os.path.join(os.path.dirname(__file__), "workers")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs a script in a fresh worker as tfscale-train starts (tests/fresh_worker.py).
FRESH_WORKER = os.path.join(REPO_ROOT, "tests", "fresh_worker.py")
FRESH_WORKER_IMPORTS = "tfscale.strategy"  # what fresh_worker.py imports first


@dataclasses.dataclass
class Run:
    returncode: int
    output: str  # the launcher's combined, worker-prefixed output
    results: list  # one JSON value per worker (None where none was written)


def run_workers(script, num_workers, tmp_path, args=(), timeout=300, env=None):
    """Runs tests/workers/`script` on `num_workers` workers of a reused pool
    (tests/worker_pool.py): the same script in every worker, as
    `tfscale-launch` would start it, without starting new processes.

    `env`: variables set while the script runs (read at run time, not at
    TensorFlow's import). A script that kills, stops or restarts workers,
    or whose workers must fail, needs `launch_workers`.
    """
    results_dir = _results_dir(tmp_path, script, num_workers)
    return _run_in_pool({"script": os.path.join(WORKERS_DIR, script)}, num_workers,
                        tmp_path, args, timeout,
                        dict(env or {}, TFSCALE_TEST_RESULTS=str(results_dir)),
                        results_dir)


def run_train(num_workers, tmp_path, args=(), timeout=300):
    """`tfscale-launch --num_workers=N -- tfscale-train args...` in the
    reused workers: `python -m tfscale.launch.train` in each, with the
    launcher's TF_CONFIG and thread share. `Run.results` is empty."""
    return run_module("tfscale.launch.train", num_workers, tmp_path, args, timeout)


def run_module(module, num_workers, tmp_path, args=(), timeout=300):
    """`tfscale-launch --num_workers=N -- python -m module args...` in the
    reused workers. `Run.results` is empty."""
    return _run_in_pool({"module": module}, num_workers, tmp_path, args,
                        timeout, {}, None)


def _run_in_pool(target, num_workers, tmp_path, args, timeout, env, results_dir):
    base = dict(_import_env(), **threads.worker_environment(num_workers))
    codes, output, why = worker_pool.pool(num_workers, base).run(
        target, args, tmp_path, env, timeout)
    if why is not None:
        output += f"worker pool: {target}: {why}; the pool is replaced\n"
    failed = [c for c in codes if c]
    returncode = 0 if why is None else (failed[0] if failed else 1)
    results = [] if results_dir is None else _read_results(results_dir, num_workers)
    return Run(returncode, output, results)


def launch_workers(script, num_workers, tmp_path, why, args=(), timeout=300, env=None,
                   launcher_args=(), fresh=False):
    """Runs tests/workers/`script` as `num_workers` processes of its own
    through tfscale-launch, for tests that must own their processes; `why`
    says why in one line (tests/README.md lists them). Each has TensorFlow
    imported as tfscale-train imports it (tests/fresh_worker.py): forked
    from a process that imported it (`--preload`, launch/preload.py, with
    the launcher forked as `popen` forks, see `preloaded`), or with `fresh`,
    where what a new interpreter starts with is the point, importing it
    itself. `env`: variables the script reads once it runs.
    `launcher_args`: flags of tfscale-launch itself, e.g. `--grace_seconds=30`."""
    assert why, "say why this test needs processes of its own"
    results_dir = _results_dir(tmp_path, script, num_workers)
    start = [] if fresh else [f"--preload={FRESH_WORKER_IMPORTS}"]
    command = [
        sys.executable, "-m", "tfscale.launch.local",
        f"--num_workers={num_workers}", f"--timeout={timeout}", *start, *launcher_args, "--",
        sys.executable, FRESH_WORKER, os.path.join(WORKERS_DIR, script), *args,
    ]
    run_env = worker_env(tmp_path, dict(env or {}, TFSCALE_TEST_RESULTS=str(results_dir)))
    if fresh:
        process = subprocess.run(
            command, cwd=str(tmp_path), env=run_env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=timeout + 60)
    else:
        process = run(preloaded(command), tmp_path, run_env, timeout + 60,
                      run_time=tuple(env or ()))
    return Run(process.returncode, process.stdout, _read_results(results_dir, num_workers))


def _results_dir(tmp_path, script, num_workers):
    results_dir = tmp_path / f"results-{script}-{num_workers}"
    results_dir.mkdir(parents=True, exist_ok=True)
    for stale in results_dir.glob("worker-*.json"):
        stale.unlink()
    return results_dir


def _read_results(results_dir, num_workers):
    results = []
    for index in range(num_workers):
        path = results_dir / f"worker-{index}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def assert_succeeded(run):
    assert run.returncode == 0, f"workers failed:\n{run.output[-6000:]}"
    missing = [i for i, r in enumerate(run.results) if r is None]
    assert not missing, f"workers {missing} wrote no result:\n{run.output[-6000:]}"


def worker_env(tmp_path, extra=None):
    """Environment for a worker process started by a test."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               TFSCALE_TEST_RESULTS=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, WORKERS_DIR, os.environ.get("PYTHONPATH")) if p
    )
    env.pop("TF_CONFIG", None)
    # pytest's name for the test phase under way: a worker is no test, and a
    # preload process serves only workers of the environment it started in
    # (tests/worker_pool.py).
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra or {})
    return env


# Read by a test's worker only once it runs (tests/workers/report.py), so
# it may differ from the preload process's (tests/worker_pool.py).
_RUN_TIME = ("TFSCALE_TEST_RESULTS",)


def _import_env():
    """The environment the pools' workers import TensorFlow with: a worker's
    (`worker_env`) less what is read only at run time."""
    env = worker_env("")
    for name in _RUN_TIME:
        env.pop(name)
    return env


def popen(command, cwd, env, stdout, run_time=()):
    """Starts `command` (tfscale-train, `python SCRIPT`, `python -m MODULE`)
    as a process of the test's own, as `subprocess.Popen(command, cwd=cwd,
    env=env, stdout=stdout, stderr=subprocess.STDOUT,
    start_new_session=True)` would, but forked from the process that
    imported tfscale's core for the pools (tests/worker_pool.py), as
    TensorFlow's tests start every process from one forkserver
    (tensorflow/python/distribute/multi_process_lib.py): its
    environment, working directory, argv, sys.path[0] and session are a
    fresh one's, its import is not (tests that are about that start theirs
    with `subprocess`). Killed, stopped or failing, it is nobody else's.

    `env`: `worker_env`'s, and beside it only `run_time`, variables the
    process reads once it runs (not at TensorFlow's import). `stdout`:
    `subprocess.PIPE` (then `.stdout` gives its output as text),
    `subprocess.DEVNULL` or an open file. Returns a `Forked`.
    """
    target = preload.python_target(command)
    if target is None:
        raise ValueError(f"popen forks Python processes; {command[0]!r} is not one")
    ignored = (*_RUN_TIME, *run_time, *preload.PER_WORKER)
    import_env = {k: v for k, v in env.items() if k not in ignored}
    expected = {k: v for k, v in _import_env().items() if k not in ignored}
    differs = sorted(k for k in set(import_env) | set(expected)
                     if import_env.get(k) != expected.get(k))
    if differs:
        raise ValueError(
            f"popen: {differs} differ from the pools' environment at import; pass "
            "`run_time=` for variables read only at run time, or start the "
            "process with subprocess where its import is the point")
    devnull = None
    if stdout == subprocess.DEVNULL:
        stdout = devnull = open(os.devnull, "wb")
    try:
        worker = worker_pool.fork(target, env, _import_env(), cwd=str(cwd),
                                  output=None if stdout == subprocess.PIPE else stdout)
    finally:
        if devnull is not None:
            devnull.close()
    return Forked(worker, command)


# Runs a launcher with its preload process forked from it (see `preloaded`).
PRELOADED_LAUNCHER = os.path.join(REPO_ROOT, "tests", "preloaded_launcher.py")


def preloaded(command):
    """`command`, tfscale-launch or tfscale-bench with
    `--preload=tfscale.strategy`, as `popen` and `run` start it with its
    preload process forked from the launcher (tests/preloaded_launcher.py),
    which has imported tfscale's core already: the launcher and its workers
    are a run's own processes, as they would be started anew, without a new
    interpreter importing TensorFlow for them. Tests of the preload process
    itself start theirs with `subprocess`."""
    return [sys.executable, PRELOADED_LAUNCHER, *command]


def run(command, cwd, env, timeout, run_time=()):
    """`popen`, then waits: as `subprocess.run(command, cwd=cwd, env=env,
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    timeout=timeout)` would; the process is killed on timeout."""
    process = popen(command, cwd, env, subprocess.PIPE, run_time)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, output)


class Forked:
    """A process started by `popen`: the part of `subprocess.Popen`'s
    interface the tests use."""

    def __init__(self, worker, args):
        self._worker = worker
        self.args = args
        self.pid = worker.pid
        self.stdout = (None if worker.stdout is None
                       else io.TextIOWrapper(worker.stdout, errors="replace"))

    @property
    def returncode(self):
        return self._worker.returncode

    def poll(self):
        return self._worker.poll()

    def wait(self, timeout=None):
        try:
            return self._worker.wait(timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout) from None

    def communicate(self, timeout=None):
        """(its whole output, None) once it has exited."""
        output = []
        reader = threading.Thread(target=lambda: output.append(self.stdout.read()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait()
        return output[0], None

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def cluster_tf_configs(tasks):
    """The TF_CONFIG of each task of a cluster on free 127.0.0.1 ports.

    Args:
        tasks: `(job, index)` of each task, each job's indices in order, e.g.
            `[("worker", 0), ("worker", 1), ("evaluator", 0)]`; every task's
            TF_CONFIG names the whole cluster, as Kubeflow's TFJob writes it.
    """
    from tfscale.launch import ports

    addresses = [f"127.0.0.1:{p}" for p in ports.free_ports("127.0.0.1", len(tasks))]
    cluster = {}
    for (job, index), address in zip(tasks, addresses, strict=True):
        assert index == len(cluster.setdefault(job, [])), tasks
        cluster[job].append(address)
    return [json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
            for job, index in tasks]


def start_process(command, tmp_path, log_name, tf_config, extra_env=None):
    """Starts `command` with `tf_config` (`popen`; `extra_env` is read at run
    time), its output to tmp_path/log_name."""
    env = worker_env(tmp_path, dict(extra_env or {}, TF_CONFIG=tf_config))
    with open(tmp_path / log_name, "w") as log:
        return popen(command, tmp_path, env, log, run_time=tuple(extra_env or ()))


def start_cluster(commands, tmp_path, extra_env=None, tasks=None):
    """Starts one process per command, each with its TF_CONFIG, without the
    launcher (so nothing stops the others when one fails).

    `tasks`: see `cluster_tf_configs`; default: workers 0..N-1, as
    tfscale-launch configures them. Returns the processes (`popen`'s); each
    one's output goes to tmp_path/worker-I.log (I: the command's position).
    """
    tasks = tasks or [("worker", index) for index in range(len(commands))]
    configs = cluster_tf_configs(tasks)
    return [start_process(command, tmp_path, f"worker-{index}.log", config, extra_env)
            for index, (command, config) in enumerate(zip(commands, configs, strict=True))]


def pids_with_env(marker):
    """Pids of live processes whose environment contains `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            pids.append(int(entry))
    return pids


def pid_alive(pid):
    """Whether process `pid` runs (a zombie has ended, for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def started_pid(launcher_output, slot, restart=0):
    """The pid of the worker of `slot` in launch `restart`, as tfscale-launch
    named it in `launcher_output` ("launch R started worker I (slot S) pid P
    ..."), or None. Fresh or forked from --preload alike. After a relaunch on
    fresh ports (a port taken) the last such line is the live one: call it
    once the launch has made progress."""
    started = re.findall(rf"tfscale-launch: launch {restart} started (.*)\.$",
                         launcher_output, re.MULTILINE)
    if not started:
        return None
    pid = re.search(rf"\(slot {slot}\) pid (\d+) ", started[-1])
    return int(pid.group(1)) if pid else None


def saved_step(directory):
    """The step of the newest tfscale.checkpoint in `directory` (0: none yet,
    or `state.json` being replaced)."""
    try:
        with open(os.path.join(directory, "state.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError):
        return 0


def netns_not_permitted_reason():
    """Why network namespaces with tc rate limits cannot be made here, or None."""
    if os.geteuid() != 0:
        return f"needs root to create network namespaces (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    name = f"tfscale-permission-check-{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if add.returncode != 0:
        return f"`ip netns add` failed: {add.stderr.strip()}"
    try:
        tbf = subprocess.run(
            ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf",
             "rate", "1mbit", "burst", "32kb", "latency", "50ms"],
            capture_output=True, text=True,
        )
        if tbf.returncode != 0:
            return f"`tc qdisc add ... tbf` failed: {tbf.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


def checkpoint_variables(directory):
    """(step, {name: array}) of the newest tfscale.checkpoint in `directory`."""
    import tensorflow as tf

    with open(os.path.join(directory, "state.json")) as f:
        state = json.load(f)
    reader = tf.train.load_checkpoint(os.path.join(directory, state["checkpoint"], "ckpt"))
    names = [n for n in reader.get_variable_to_shape_map() if "OBJECT_CONFIG" not in n]
    return state["step"], {n: reader.get_tensor(n) for n in names}


def flip_bytes(checkpoint_dir):
    """Bit rot: a few bytes of the checkpoint's data shard inverted."""
    (data,) = [p for p in checkpoint_dir.iterdir() if ".data-" in p.name]
    raw = bytearray(data.read_bytes())
    for offset in range(len(raw) // 2, len(raw) // 2 + 4):
        raw[offset] ^= 0xFF
    data.write_bytes(bytes(raw))
