"""Who can reach a worker: TensorFlow's gRPC server listens on all interfaces,
unauthenticated, so tfscale-launch runs the workers in a network namespace of
their own where it can (`--isolate=auto`, the default), and says which it did.

The isolation tests need root and iproute2 and skip otherwise, saying why.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from multiworker import REPO_ROOT, WORKERS_DIR, netns_not_permitted_reason

pytestmark = pytest.mark.multiworker


LISTENING_WORKER = os.path.join(WORKERS_DIR, "listening_worker.py")
LAUNCH_PROBE = os.path.join(WORKERS_DIR, "launch_probe.py")


def external_address():
    """This machine's first global IPv4 address, or None."""
    listed = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                            capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        return line.split()[3].split("/")[0]
    return None


@pytest.fixture(scope="module")
def isolation_permitted():
    reason = netns_not_permitted_reason()
    if reason:
        pytest.skip(f"network namespaces are not permitted here: {reason}")
    if external_address() is None:
        pytest.skip("this machine has no global IPv4 address to probe from")


def _env(tmp_path, **extra):
    env = dict(os.environ, TFSCALE_TEST_RESULTS=str(tmp_path), PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, WORKERS_DIR, os.environ.get("PYTHONPATH")) if p)
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def reachable(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


def start_listening_workers(tmp_path, num_workers, isolate):
    """tfscale-launch of `num_workers` listening workers; returns the launcher
    and each worker's report once every worker's gRPC server is up."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfscale.launch.local", f"--num_workers={num_workers}",
         f"--isolate={isolate}", "--timeout=150", "--",
         sys.executable, LISTENING_WORKER],
        cwd=str(tmp_path), env=_env(tmp_path), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    paths = [tmp_path / f"worker-{i}.json" for i in range(num_workers)]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in paths):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            out, err = launcher.communicate()
            pytest.fail(f"workers did not come up:\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.2)
    return launcher, [json.loads(p.read_text()) for p in paths]


def release(tmp_path, launcher):
    (tmp_path / "release").touch()
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    return out, err


def test_isolated_workers_cannot_be_reached_through_the_external_address(
        isolation_permitted, tmp_path):
    launcher, workers = start_listening_workers(tmp_path, 2, isolate="yes")
    try:
        outside = external_address()
        namespace = None
        for worker in workers:
            host, port = worker["address"].rsplit(":", 1)
            port = int(port)
            assert worker["num_workers"] == 2  # they formed one cluster
            assert worker["netns"] != os.readlink("/proc/self/ns/net")
            assert not reachable(outside, port), f"{outside}:{port} is reachable"
            assert not reachable("127.0.0.1", port)
            # The port does listen: inside the workers' namespace it answers.
            namespace = namespace or next(
                line.split()[0] for line in subprocess.run(
                    ["ip", "netns", "list"], capture_output=True, text=True
                ).stdout.splitlines() if line.startswith(f"tfscale-{launcher.pid}-"))
            inside = subprocess.run(
                ["ip", "netns", "exec", namespace, sys.executable, "-c",
                 f"import socket; socket.create_connection(({host!r}, {port}), 3)"],
                capture_output=True, text=True)
            assert inside.returncode == 0, inside.stderr
    finally:
        out, err = release(tmp_path, launcher)
    assert (f"tfscale-launch: workers isolated in network namespace {namespace}"
            in err)
    assert "nothing outside it can reach their ports" in err


def test_without_isolation_a_worker_is_reachable_through_the_external_address(
        isolation_permitted, tmp_path):
    # What --isolate protects against: TensorFlow binds every interface.
    launcher, (worker,) = start_listening_workers(tmp_path, 1, isolate="no")
    try:
        port = int(worker["address"].rsplit(":", 1)[1])
        assert worker["address"].startswith("127.0.0.1:")
        assert reachable(external_address(), port)
    finally:
        release(tmp_path, launcher)


def _launch_probe(tmp_path, isolate):
    # Without `ip` on PATH isolation is impossible, as it is without root.
    return subprocess.run(
        [sys.executable, "-m", "tfscale.launch.local", "--num_workers=2",
         f"--isolate={isolate}", "--", sys.executable, LAUNCH_PROBE, "ok"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
        env=_env(tmp_path, PATH=os.path.dirname(sys.executable)))


def test_where_isolation_is_impossible_auto_says_the_workers_are_exposed(tmp_path):
    done = _launch_probe(tmp_path, "auto")
    assert done.returncode == 0, done.stderr
    assert ("tfscale-launch: workers listen on all interfaces of this machine, "
            "unauthenticated (not isolated: ") in done.stderr
    assert "(docs/security.md)" in done.stderr
    assert done.stdout.count("tf_config=") == 2


def test_where_isolation_is_impossible_yes_refuses_before_starting(tmp_path):
    done = _launch_probe(tmp_path, "yes")
    assert done.returncode == 2
    assert "tfscale-launch: cannot isolate the workers: " in done.stderr
    assert "--isolate=no" in done.stderr
    assert "tf_config=" not in done.stdout
