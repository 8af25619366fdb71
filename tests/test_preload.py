"""`tfscale-launch --preload`: TensorFlow workers forked from one process
that imported it (launch/preload.py) form a cluster, in the launcher's
namespace or in emulated nodes, train with tfscale-train, and die with the
launcher; bad uses are refused in one line. The launcher behaviours that
hold both ways (exit codes, restarts, timeouts, signals) are in
test_launch.py, parametrized fresh and forked."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import multiworker
from multiworker import netns_not_permitted_reason
from multiworker import pid_alive
from multiworker import worker_env
from multiworker import WORKERS_DIR
from tfscale.launch import preload

pytestmark = pytest.mark.multiworker

PROBE = os.path.join(WORKERS_DIR, "launch_probe.py")
LAUNCH = [sys.executable, "-m", "tfscale.launch.local"]


def launch(*args, timeout=240, cwd=None):
    return subprocess.run(
        [*LAUNCH, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, timeout=timeout, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


def test_forked_workers_build_a_strategy_and_reduce_across_the_cluster():
    process = launch("--num_workers=2", "--preload=tfscale.strategy,tfscale.launch.ports",
                     "--", sys.executable, PROBE, "strategy")
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert sorted(re.findall(r"\[worker (\d)\] preloaded=True session_leader=True",
                             process.stdout)) == ["0", "1"]
    assert sorted(re.findall(r"\[worker (\d)\] sum=3.0", process.stdout)) == ["0", "1"]


def test_forked_workers_in_emulated_nodes_each_reach_the_other_node():
    reason = netns_not_permitted_reason()
    if reason:
        pytest.skip(reason)
    process = launch("--num_workers=2", "--emulate_nodes=2",
                     "--preload=tfscale.strategy,tfscale.launch.ports", "--",
                     sys.executable, PROBE, "strategy")
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    # Each worker listens on its own node's address, which exists only in
    # that node's namespace: a worker left outside it could not bind.
    assert '["10.213.0.1:' in process.stdout and '", "10.213.0.2:' in process.stdout
    assert sorted(re.findall(r"\[worker (\d)\] preloaded=True", process.stdout)) == ["0", "1"]
    assert sorted(re.findall(r"\[worker (\d)\] sum=3.0", process.stdout)) == ["0", "1"]


def test_tfscale_train_forked_from_a_preload_exports_its_model(tmp_path):
    process = launch("--num_workers=2", "--preload=tfscale.strategy", "--",
                     "tfscale-train", "--model=alexnet_bn_small", "--epochs=1",
                     f"--export_dir={tmp_path / 'export'}",
                     cwd=str(tmp_path))
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert (tmp_path / "export" / "saved_model.pb").exists()
    assert f"[worker 0] Exported SavedModel to {tmp_path / 'export'}" in process.stdout


def test_killing_the_launcher_kills_its_forked_workers_and_their_children():
    launcher = subprocess.Popen(
        [*LAUNCH, "--num_workers=2", "--preload=tfscale.launch.ports", "--",
         sys.executable, PROBE, "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = []
    deadline = time.monotonic() + 120
    while sum("child=" in line for line in lines) < 2 and time.monotonic() < deadline:
        lines.append(launcher.stdout.readline())
    pids = [int(p) for p in re.findall(r"(?:pid|child)=(\d+)", "".join(lines))]
    assert len(pids) == 4, lines
    launcher.kill()
    launcher.wait()
    # PR_SET_PDEATHSIG SIGKILLs each worker; the children of a worker are in
    # its session, which nothing stops then: the probe's child sleeps, so
    # only the workers are certain to go. Bounded generously: an event.
    workers = [int(p) for p in re.findall(r"pid=(\d+)", "".join(lines))]
    deadline = time.monotonic() + 60
    while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if pid_alive(p)], "workers outlived the launcher"
    for child in set(pids) - set(workers):
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_command_that_is_not_python_is_refused_with_preload():
    process = launch("--num_workers=2", "--preload=tensorflow", "--", "true")
    assert process.returncode == 2
    assert "--preload forks Python workers: the command must be `python SCRIPT`" in (
        process.stderr)
    assert "'true' is none of these" in process.stderr


def test_a_preload_module_that_fails_to_import_is_named():
    process = launch("--num_workers=2", "--preload=tfscale_no_such_module", "--",
                     sys.executable, PROBE, "ok")
    assert process.returncode == 2
    assert ("[preload] ModuleNotFoundError: No module named 'tfscale_no_such_module'"
            in process.stdout)
    assert ("tfscale-launch: the preload process (--preload=tfscale_no_such_module) "
            "exited with code 1 before starting a worker; its output is above, "
            "prefixed [preload].") in process.stderr


# ------------------------------------------- a preload process handed down
# `preload.hand_down`: the launcher takes a preload process forked from the
# process it runs in (tests/preloaded_launcher.py), as the suite's launches do.

def _interpreter_log(tmp_path):
    """An environment in which each new Python interpreter appends its
    command line to the returned file (a sitecustomize.py on PYTHONPATH,
    read at an interpreter's start only), and that file."""
    site = tmp_path / "site"
    site.mkdir()
    log = tmp_path / "interpreters.log"
    (site / "sitecustomize.py").write_text(
        "with open('/proc/self/cmdline', 'rb') as f:\n"
        "    line = f.read().rstrip(b'\\0').replace(b'\\0', b' ').decode()\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(line + '\\n')\n")
    base = worker_env(tmp_path)
    env = dict(base, PYTHONPATH=os.pathsep.join([str(site), base["PYTHONPATH"]]))
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    assert log.read_text() == f"{sys.executable} -c pass\n"  # it sees one
    log.unlink()
    return env, log


def test_a_launcher_handed_a_preload_process_forks_its_workers_from_it_and_starts_no_interpreter(
        tmp_path):
    env, log = _interpreter_log(tmp_path)
    process = multiworker.run(
        multiworker.preloaded([*LAUNCH, "--num_workers=2", "--preload=tfscale.strategy",
                               "--", sys.executable, PROBE, "strategy"]),
        tmp_path, env, timeout=240, run_time=("PYTHONPATH",))
    assert process.returncode == 0, process.stdout[-3000:]
    assert sorted(re.findall(r"\[worker (\d)\] preloaded=\w+ session_leader=True",
                             process.stdout)) == ["0", "1"]
    assert sorted(re.findall(r"\[worker (\d)\] sum=3.0", process.stdout)) == ["0", "1"]
    assert not log.exists(), log.read_text()


def test_a_launcher_of_other_modules_ends_the_handed_down_process_and_starts_its_own(
        tmp_path):
    env, log = _interpreter_log(tmp_path)
    process = multiworker.run(
        multiworker.preloaded([*LAUNCH, "--num_workers=2",
                               "--preload=tfscale.strategy,tfscale.launch.ports",
                               "--", sys.executable, PROBE, "strategy"]),
        tmp_path, env, timeout=240, run_time=("PYTHONPATH",))
    assert process.returncode == 0, process.stdout[-3000:]
    assert sorted(re.findall(r"\[worker (\d)\] sum=3.0", process.stdout)) == ["0", "1"]
    (started,) = log.read_text().splitlines()
    assert started.startswith(f"{sys.executable} -m tfscale.launch.preload ")
    assert started.endswith(" tfscale.strategy,tfscale.launch.ports")


def test_hand_down_refuses_modules_not_imported_before_it_forks():
    with pytest.raises(preload.PreloadError, match=r"\['tfscale_not_imported'\] not imported"):
        preload.hand_down(["json", "tfscale_not_imported"])
