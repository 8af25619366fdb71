"""tfscale-launch: TF_CONFIG per worker, output prefixes, failure and timeout."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from multiworker import WORKERS_DIR

PROBE = os.path.join(WORKERS_DIR, "launch_probe.py")


def launch(*args, timeout=120):
    start = time.monotonic()
    process = subprocess.run(
        [sys.executable, "-m", "launch.local", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
    )
    return process, time.monotonic() - start


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_each_worker_gets_its_own_tf_config_and_prefixed_output():
    process, _ = launch("--num_workers=3", "--", sys.executable, PROBE, "ok")
    assert process.returncode == 0, process.stderr
    configs = {}
    for line in process.stdout.splitlines():
        match = re.match(r"\[worker (\d)\] pid=\d+ tf_config=(.*)", line)
        if match:
            configs[int(match.group(1))] = json.loads(match.group(2))
    assert sorted(configs) == [0, 1, 2]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for index, config in configs.items():
        assert config["cluster"]["worker"] == addresses
        assert config["task"] == {"type": "worker", "index": index}


def test_a_failed_worker_stops_the_others_and_is_named():
    process, seconds = launch(
        "--num_workers=3", "--grace_seconds=2", "--",
        sys.executable, PROBE, "fail", "1",
    )
    assert process.returncode == 3
    assert "worker 1 exited with code 3; stopped the other workers." in process.stderr
    assert seconds < 60  # the others sleep for 600 s
    pids = [int(p) for p in re.findall(r"(?:pid|child)=(\d+)", process.stdout)]
    assert pids and not [p for p in pids if pid_alive(p)], "orphans left"


def test_timeout_stops_every_worker_and_their_children():
    process, seconds = launch(
        "--num_workers=2", "--timeout=5", "--grace_seconds=2", "--",
        sys.executable, PROBE, "sleep",
    )
    assert process.returncode == 124
    assert "timed out after 5 s" in process.stderr
    assert seconds < 60
    pids = [int(p) for p in re.findall(r"(?:pid|child)=(\d+)", process.stdout)]
    assert len(pids) == 4 and not [p for p in pids if pid_alive(p)]


def test_missing_command_is_a_usage_error():
    process, _ = launch("--num_workers=2")
    assert process.returncode != 0
    assert "No command given" in process.stderr


def test_unknown_command_is_named():
    process, _ = launch("--num_workers=2", "--", "no-such-command-tfscale")
    assert process.returncode == 127
    assert "command not found: 'no-such-command-tfscale'" in process.stderr
