"""tfscale-launch: TF_CONFIG per worker, output prefixes, failure, timeout, and
relaunch on fresh ports when a worker's port was taken."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from multiworker import REPO_ROOT
from multiworker import netns_not_permitted_reason
from multiworker import pid_alive
from multiworker import WORKERS_DIR
from multiworker import started_pid
from tfscale.launch import threads

pytestmark = pytest.mark.multiworker

PROBE = os.path.join(WORKERS_DIR, "launch_probe.py")


def launch(*args, timeout=120, env=None):
    start = time.monotonic()
    process = subprocess.run(
        [sys.executable, "-m", "tfscale.launch.local", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
        env=env,
    )
    return process, time.monotonic() - start


# The launcher behaviours parametrized with START hold for fresh workers and
# for workers forked from a preload process (--preload, launch/preload.py).
START = [pytest.param((), id="fresh"),
         pytest.param(("--preload=tfscale.launch.ports",), id="forked")]


def started_as(start, stdout):
    """Checks launch_probe's report: forked under --preload, fresh
    otherwise, and a session leader either way (so killpg reaches what a
    worker starts)."""
    reports = re.findall(r"\] preloaded=(\w+) session_leader=(\w+)", stdout)
    assert reports and set(reports) == {(str(bool(start)), "True")}, reports


@pytest.mark.parametrize("start", START)
def test_each_worker_gets_its_tf_config_prefixed_output_and_named_pid(start):
    process, _ = launch("--num_workers=3", *start, "--", sys.executable, PROBE, "ok")
    assert process.returncode == 0, process.stderr
    started_as(start, process.stdout)
    configs, pids = {}, {}
    for line in process.stdout.splitlines():
        match = re.match(r"\[worker (\d)\] pid=(\d+) tf_config=(.*)", line)
        if match:
            pids[int(match.group(1))] = int(match.group(2))
            configs[int(match.group(1))] = json.loads(match.group(3))
    assert sorted(configs) == [0, 1, 2]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for index, config in configs.items():
        assert config["cluster"]["worker"] == addresses
        assert config["task"] == {"type": "worker", "index": index}
    # The launcher names each worker's own pid (os.getpid() in the worker).
    assert ("tfscale-launch: launch 0 started " + ", ".join(
        f"worker {i} (slot {i}) pid {pids[i]} at {addresses[i]}" for i in range(3))
        + ".") in process.stderr.splitlines()
    assert [started_pid(process.stderr, slot) for slot in range(3)] == [
        pids[slot] for slot in range(3)]


def test_each_worker_gets_a_share_of_the_cores_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k != threads.VARIABLE}
    cores = threads.usable_cores()
    share = str(max(1, cores // 3))
    process, _ = launch("--num_workers=3", "--", sys.executable, PROBE, "ok", env=env)
    assert process.returncode == 0, process.stderr
    assert re.findall(r"\[worker \d\] intra_op_threads=(\S+)", process.stdout) == [share] * 3
    assert (f"tfscale-launch: each worker gets TF_NUM_INTRAOP_THREADS={share} ({cores} "
            "cores for 3 workers; set TF_NUM_INTRAOP_THREADS to choose).") in process.stdout
    process, _ = launch("--num_workers=3", "--", sys.executable, PROBE, "ok",
                        env=dict(env, TF_NUM_INTRAOP_THREADS="5"))
    assert process.returncode == 0, process.stderr
    assert re.findall(r"\[worker \d\] intra_op_threads=(\S+)", process.stdout) == ["5"] * 3
    assert "each worker gets" not in process.stdout


@pytest.mark.parametrize("start", START)
def test_a_failed_worker_stops_the_others_and_is_named(start):
    process, seconds = launch(
        "--num_workers=3", "--grace_seconds=2", *start, "--",
        sys.executable, PROBE, "fail", "1",
    )
    assert process.returncode == 3
    started_as(start, process.stdout)
    assert "worker 1 exited with code 3; stopped the other workers." in process.stderr
    assert seconds < 60  # the others sleep for 600 s
    pids = [int(p) for p in re.findall(r"(?:pid|child)=(\d+)", process.stdout)]
    assert pids and not [p for p in pids if pid_alive(p)], "orphans left"


@pytest.mark.parametrize("start", START)
def test_timeout_stops_every_worker_and_their_children(start):
    process, seconds = launch(
        "--num_workers=2", "--timeout=5", "--grace_seconds=2", *start, "--",
        sys.executable, PROBE, "sleep",
    )
    assert process.returncode == 124
    started_as(start, process.stdout)
    assert "timed out after 5 s" in process.stderr
    assert seconds < 60
    pids = [int(p) for p in re.findall(r"(?:pid|child)=(\d+)", process.stdout)]
    assert len(pids) == 4 and not [p for p in pids if pid_alive(p)]


def test_missing_command_is_one_line_without_the_flag_listing():
    process, _ = launch("--num_workers=2")
    assert process.returncode != 0
    assert "tfscale-launch: no command given. Usage: tfscale-launch" in process.stderr
    assert "--num_workers" not in process.stderr.replace(
        "--num_workers=N", "").replace("--num_workers=2", "")


def test_unknown_command_is_named():
    process, _ = launch("--num_workers=2", "--", "no-such-command-tfscale")
    assert process.returncode == 127
    assert "command not found: 'no-such-command-tfscale'" in process.stderr


def launch_with_taken_port(mode, taken_attempts):
    """Runs `launch.local.launch` on 2 launch_probe workers whose first
    `taken_attempts` attempts give worker 0 a port this test holds (bound and
    listening). Returns (process, the held port)."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        script = f"""
import sys
from tfscale.launch import local
from tfscale.launch import ports

attempts = []
def pick_ports(host, count):
    attempts.append(count)
    picked = ports.free_ports(host, count)
    return [{port}] + picked[1:] if len(attempts) <= {taken_attempts} else picked
code = local.launch([sys.executable, {PROBE!r}, {mode!r}], 2, timeout=240,
                    grace_seconds=2, pick_ports=pick_ports,
                    isolate="no")
print(f"attempts={{len(attempts)}}", file=sys.stderr)
sys.exit(code)
"""
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
        process = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, timeout=300,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, port


def test_a_tensorflow_worker_whose_port_was_taken_makes_the_launcher_relaunch_all():
    process, port = launch_with_taken_port("strategy", 1)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    # tfscale.Strategy finds the port taken before TensorFlow's server would.
    assert (f"[worker 0] tfscale.startup.StartupError: worker 0 cannot listen on port {port} of "
            f"its address 127.0.0.1:{port}: Address already in use.") in process.stdout
    assert (f"tfscale-launch: worker 0 could not bind 127.0.0.1:{port}; stopped every "
            "worker, relaunching all on fresh ports (attempt 2 of 3).") in process.stderr
    assert "attempts=2" in process.stderr
    # The relaunched pair formed a cluster: each worker saw both contributions.
    assert sorted(re.findall(r"\[worker (\d)\] sum=3.0", process.stdout)) == ["0", "1"]


def test_the_launcher_gives_up_after_its_port_attempts_naming_the_worker():
    process, port = launch_with_taken_port("bind", 99)
    assert process.returncode == 1
    assert "Address already in use" in process.stdout
    assert "(attempt 2 of 3)" in process.stderr and "(attempt 3 of 3)" in process.stderr
    assert "attempts=3" in process.stderr
    assert "tfscale-launch: worker 0 exited with code 1; stopped the other workers." in (
        process.stderr)


def launches(stdout):
    """{restart: {worker index: (slot, TF_CONFIG)}} from launch_probe's lines."""
    seen = {}
    pending = {}
    for line in stdout.splitlines():
        match = re.match(r"\[worker (\d+)\] (?:pid=\d+ tf_config=(.*)|slot=(\d+) restart=(\d+))$",
                         line)
        if not match:
            continue
        index = int(match.group(1))
        if match.group(2):
            pending[index] = json.loads(match.group(2))
        else:
            slot, restart = int(match.group(3)), int(match.group(4))
            seen.setdefault(restart, {})[index] = (slot, pending.pop(index))
    return seen


def failure_lines(stderr):
    """The launcher's lines about failed workers (not where they run)."""
    return [l for l in stderr.splitlines() if l.startswith("tfscale-launch: worker ")]


def no_orphans(stdout):
    pids = [int(p) for p in re.findall(r"(?:pid|child)=(\d+)", stdout)]
    return pids and not [p for p in pids if pid_alive(p)]


@pytest.mark.parametrize("start", START)
def test_a_failed_worker_makes_the_launcher_restart_all_on_fresh_ports(start):
    process, seconds = launch(
        "--num_workers=3", "--max_restarts=3", "--grace_seconds=2", *start, "--",
        sys.executable, PROBE, "flaky", "1", "2",
    )
    assert process.returncode == 0, process.stderr
    started_as(start, process.stdout)
    assert len(failure_lines(process.stderr)) == 2, process.stderr
    for restart in (1, 2):
        assert ("tfscale-launch: worker 1 exited with code 3; stopped the other "
                f"workers; restart {restart} of 3 on fresh ports.") in process.stderr
    seen = launches(process.stdout)
    assert sorted(seen) == [0, 1, 2]  # TFSCALE_RESTART_COUNT of each launch
    ports = []
    for restart, workers in seen.items():
        assert sorted(workers) == [0, 1, 2]
        for index, (slot, config) in workers.items():
            assert slot == index and config["task"]["index"] == index
        ports.append({a.rsplit(":", 1)[1] for a in workers[0][1]["cluster"]["worker"]})
    assert len(set().union(*ports)) == 9, f"ports reused: {ports}"
    assert no_orphans(process.stdout), "orphans left"  # the sleeping peers too
    assert seconds < 60


@pytest.mark.parametrize("start", START)
def test_a_killed_worker_is_named_with_its_signal_in_the_restart_line(start):
    process, _ = launch(
        "--num_workers=2", "--max_restarts=1", "--grace_seconds=2", *start, "--",
        sys.executable, PROBE, "flaky", "0", "1", "kill",
    )
    assert process.returncode == 0, process.stderr
    started_as(start, process.stdout)
    assert ("tfscale-launch: worker 0 was killed by SIGKILL; stopped the other "
            "workers; restart 1 of 1 on fresh ports.") in process.stderr


def test_when_restarts_run_out_the_launcher_fails_with_the_workers_code():
    process, _ = launch(
        "--num_workers=2", "--max_restarts=2", "--grace_seconds=2", "--",
        sys.executable, PROBE, "flaky", "1", "99",
    )
    assert process.returncode == 3
    lines = failure_lines(process.stderr)
    for restart in (1, 2):  # without --min_workers no slot is dropped
        assert lines[restart - 1] == (
            "tfscale-launch: worker 1 exited with code 3; stopped the other "
            f"workers; restart {restart} of 2 on fresh ports.")
    assert lines[2] == ("tfscale-launch: worker 1 exited with code 3; stopped the "
                        "other workers; no restart left (--max_restarts=2).")
    assert len(lines) == 3 and sorted(launches(process.stdout)) == [0, 1, 2]
    assert no_orphans(process.stdout)


def test_a_slot_failing_again_soon_after_a_restart_is_dropped_down_to_min_workers():
    process, _ = launch(
        "--num_workers=3", "--max_restarts=3", "--min_workers=2",
        "--grace_seconds=2", "--", sys.executable, PROBE, "flaky", "1", "2",
    )
    # Slot 1 fails in launch 0 and again at once in launch 1: dropped; launch
    # 2 runs slots 0 and 2 as workers 0 and 1.
    assert process.returncode == 0, process.stderr
    lines = failure_lines(process.stderr)
    assert len(lines) == 2, process.stderr
    assert lines[0].endswith("; restart 1 of 3 on fresh ports.")
    assert re.fullmatch(
        r"tfscale-launch: worker 1 exited with code 3; stopped the other workers; "
        r"dropping worker slot 1 \(failed again [\d.]+ s after restart 1\); "
        r"continuing with 2 workers: restart 2 of 3 on fresh ports\.", lines[1])
    seen = launches(process.stdout)
    assert sorted(seen) == [0, 1, 2]
    last = seen[2]
    assert {index: slot for index, (slot, _) in last.items()} == {0: 0, 1: 2}
    for index, (_, config) in last.items():
        assert len(config["cluster"]["worker"]) == 2
        assert config["task"]["index"] == index
    # The launcher's line names the slot beside the index.
    assert re.search(r"^tfscale-launch: launch 2 started worker 0 \(slot 0\) pid \d+ at "
                     r"\S+, worker 1 \(slot 2\) pid \d+ at \S+\.$", process.stderr,
                     re.MULTILINE), process.stderr


def test_a_slot_failing_again_after_the_restart_window_is_kept():
    process, _ = launch(
        "--num_workers=3", "--max_restarts=2", "--min_workers=2",
        "--restart_window=0", "--grace_seconds=2", "--",
        sys.executable, PROBE, "flaky", "1", "2",
    )
    assert process.returncode == 0, process.stderr
    assert "dropping" not in process.stderr and "restart 2 of 2" in process.stderr
    assert all(len(workers) == 3 for workers in launches(process.stdout).values())


def test_timeout_bounds_the_whole_run_including_restarts():
    process, seconds = launch(
        "--num_workers=2", "--max_restarts=100000", "--timeout=4",
        "--grace_seconds=2", "--", sys.executable, PROBE, "flaky", "1", "100000",
    )
    assert process.returncode == 124, process.stderr[-2000:]
    assert "timed out after 4 s" in process.stderr
    assert "restart 1 of 100000" in process.stderr
    assert seconds < 30
    assert no_orphans(process.stdout)


@pytest.mark.parametrize("start", START)
def test_sigterm_stops_every_worker_and_restarts_none(start):
    process = subprocess.Popen(
        [sys.executable, "-m", "tfscale.launch.local", "--num_workers=2", "--max_restarts=3",
         "--grace_seconds=2", *start, "--", sys.executable, PROBE, "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 30
    while sum("child=" in line for line in lines) < 2 and time.monotonic() < deadline:
        lines.append(process.stdout.readline())  # both workers are up
    process.terminate()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 143, err  # 128 + SIGTERM: preempted
    assert "interrupted (SIGTERM); stopped every worker." in err
    assert "restart" not in err
    assert no_orphans("".join(lines) + out)
    started_as(start, "".join(lines) + out)


@pytest.mark.parametrize("args, message", [
    (["--num_workers=2", "--min_workers=3", "--max_restarts=1"],
     "--min_workers=3: must be between 1 and --num_workers=2"),
    (["--num_workers=3", "--min_workers=2"],
     "--min_workers=2 drops worker slots only when relaunching them: give "
     "--max_restarts >= 1 as well"),
    (["--num_workers=4", "--emulate_nodes=2", "--min_workers=2", "--max_restarts=1"],
     "--min_workers=2 cannot be combined with --emulate_nodes"),
    (["--num_workers=2", "--max_restarts=-1"], "--max_restarts"),
])
def test_inconsistent_restart_flags_are_refused(args, message):
    process, _ = launch(*args, "--", sys.executable, PROBE, "ok")
    assert process.returncode != 0
    assert message in process.stderr
    assert "[worker" not in process.stdout


def gpus_seen(stdout):
    """{restart: {worker index: (slot, CUDA_VISIBLE_DEVICES)}} from launch_probe."""
    seen, slots = {}, {}
    for line in stdout.splitlines():
        match = re.match(r"\[worker (\d+)\] (?:slot=(\d+) restart=(\d+)|"
                         r"cuda_visible_devices=(.*))$", line)
        if not match:
            continue
        index = int(match.group(1))
        if match.group(2):
            slots[index] = (int(match.group(2)), int(match.group(3)))
        else:
            slot, restart = slots.pop(index)
            seen.setdefault(restart, {})[index] = (slot, match.group(4))
    return seen


def launch_with_env(args, cuda_visible_devices=None):
    """`launch(*args)` with the launcher's CUDA_VISIBLE_DEVICES set or unset."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    start = time.monotonic()
    process = subprocess.run(
        [sys.executable, "-m", "tfscale.launch.local", *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    return process, time.monotonic() - start


@pytest.mark.parametrize("launcher_devices, expected", [
    (None, ["0", "1", "2"]),
    ("5,3,7", ["5", "3", "7"]),  # the launcher's own GPUs, in its order
])
def test_gpus_per_node_gives_each_worker_one_gpu_in_local_rank_order(
        launcher_devices, expected):
    process, _ = launch_with_env(
        ["--num_workers=3", "--gpus_per_node=3", "--", sys.executable, PROBE, "ok"],
        launcher_devices)
    assert process.returncode == 0, process.stderr
    seen = gpus_seen(process.stdout)
    assert seen == {0: {i: (i, gpu) for i, gpu in enumerate(expected)}}, process.stdout


def test_without_gpus_per_node_workers_inherit_the_launchers_devices():
    for launcher_devices, expected in (("1,0", "1,0"), (None, "(unset)")):
        process, _ = launch_with_env(
            ["--num_workers=2", "--", sys.executable, PROBE, "ok"], launcher_devices)
        assert process.returncode == 0, process.stderr
        assert gpus_seen(process.stdout) == {0: {0: (0, expected), 1: (1, expected)}}


def test_a_workers_gpu_follows_its_slot_when_a_slot_is_dropped():
    process, _ = launch_with_env(
        ["--num_workers=3", "--gpus_per_node=3", "--max_restarts=3",
         "--min_workers=2", "--grace_seconds=2", "--",
         sys.executable, PROBE, "flaky", "1", "2"])
    assert process.returncode == 0, process.stderr
    assert "dropping worker slot 1" in process.stderr
    seen = gpus_seen(process.stdout)
    assert seen[0] == seen[1] == {0: (0, "0"), 1: (1, "1"), 2: (2, "2")}
    # Slot 1 (GPU 1, perhaps broken) is gone; worker 1 is slot 2 and keeps GPU 2.
    assert seen[2] == {0: (0, "0"), 1: (2, "2")}


def test_gpus_per_node_on_emulated_nodes_counts_the_local_rank_on_each_node():
    reason = netns_not_permitted_reason()
    if reason:
        pytest.skip(reason)
    process, _ = launch_with_env(
        ["--num_workers=4", "--emulate_nodes=2", "--gpus_per_node=2", "--",
         sys.executable, PROBE, "ok"])
    assert process.returncode == 0, process.stderr
    assert gpus_seen(process.stdout) == {
        0: {0: (0, "0"), 1: (1, "1"), 2: (2, "0"), 3: (3, "1")}}


@pytest.mark.parametrize("args, launcher_devices, message", [
    (["--num_workers=4", "--gpus_per_node=8"], None,
     "--gpus_per_node=8 but 4 workers per node (--num_workers=4): tfscale runs "
     "one worker per GPU; start one worker per GPU (--num_workers=8) or give "
     "--gpus_per_node=4"),
    (["--num_workers=8", "--gpus_per_node=4"], None,
     "--gpus_per_node=4 but 8 workers per node (--num_workers=8)"),
    (["--num_workers=4", "--emulate_nodes=2", "--gpus_per_node=4"], None,
     "--gpus_per_node=4 but 2 workers per node (--num_workers=4 --emulate_nodes=2): "
     "tfscale runs one worker per GPU; start one worker per GPU (--num_workers=8 "
     "--emulate_nodes=2) or give --gpus_per_node=2"),
    (["--num_workers=2", "--gpus_per_node=2"], "0,1,2",
     "--gpus_per_node=2 but this launcher's CUDA_VISIBLE_DEVICES='0,1,2' names 3 "
     "GPU(s): each worker gets one of those; unset CUDA_VISIBLE_DEVICES or make "
     "it name 2 GPUs"),
    (["--num_workers=2", "--gpus_per_node=0"], None, "--gpus_per_node"),
])
def test_gpus_per_node_that_does_not_fit_the_workers_is_refused(
        args, launcher_devices, message):
    process, _ = launch_with_env([*args, "--", sys.executable, PROBE, "ok"],
                                 launcher_devices)
    assert process.returncode != 0
    assert message in process.stderr, process.stderr
    assert "[worker" not in process.stdout
