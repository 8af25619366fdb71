"""tfscale-launch --emulate_nodes: workers in network namespaces ("nodes") with a
rate-limited link between them; cleanup on every way out; clear refusals.

Needs root and iproute2 (network namespaces, veth, tc tbf); skips otherwise,
saying why. No TensorFlow: the workers are small socket probes.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from multiworker import REPO_ROOT, WORKERS_DIR, netns_not_permitted_reason, pid_alive

LAUNCH_PROBE = os.path.join(WORKERS_DIR, "launch_probe.py")
NETNS_PROBE = os.path.join(WORKERS_DIR, "netns_probe.py")
RATE_MBIT = 40  # 4 MB take ~0.8 s at this rate
MB4 = 4_000_000


@pytest.fixture(scope="module")
def permitted():
    reason = netns_not_permitted_reason()
    if reason:
        pytest.skip(f"emulated nodes are not permitted here: {reason}")


def _env(tmp_path, **extra):
    env = dict(os.environ, TFSCALE_TEST_RESULTS=str(tmp_path), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, WORKERS_DIR, os.environ.get("PYTHONPATH")) if p
    )
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def _start(tmp_path, *args, **env):
    return subprocess.Popen(
        [sys.executable, "-m", "tfscale.launch.local", *args],
        cwd=str(tmp_path), env=_env(tmp_path, **env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C must reach it even if this test runs with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def launch(tmp_path, *args, **env):
    """Runs the launcher; (returncode, stdout, stderr, launcher pid)."""
    process = _start(tmp_path, *args, **env)
    out, err = process.communicate(timeout=90)
    return process.returncode, out, err, process.pid


def namespaces_of(pid):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in listed.stdout.splitlines()
            if line.startswith(f"tfscale-{pid}-")]


def root_links():
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    return {line.split(":")[1].strip().split("@")[0] for line in listed.stdout.splitlines()}


def assert_nothing_left(pid, stdout, links_before):
    assert namespaces_of(pid) == [], "network namespaces left behind"
    new_links = root_links() - links_before
    assert not new_links, f"links left in the root namespace: {new_links}"
    workers = [int(p) for p in re.findall(r"(?:pid|child)=(\d+)", stdout)]
    assert not [p for p in workers if pid_alive(p)], "worker processes left behind"


def tf_configs(stdout):
    configs = {}
    for line in stdout.splitlines():
        match = re.match(r"\[worker (\d+)\] pid=\d+ tf_config=(.*)", line)
        if match:
            configs[int(match.group(1))] = json.loads(match.group(2))
    return configs


def results(tmp_path, num_workers):
    return [json.loads((tmp_path / f"worker-{i}.json").read_text())
            for i in range(num_workers)]


# Flag errors: no root needed.

@pytest.mark.parametrize("args, message", [
    (["--num_workers=4", "--emulate_nodes=0"],
     "--emulate_nodes=0: must be between 1 and 250"),
    (["--num_workers=4", "--emulate_nodes=3"],
     "--num_workers=4 is not divisible by --emulate_nodes=3"),
    (["--num_workers=2", "--inter_node_rate=1mbit"],
     "--inter_node_rate/--inter_node_burst/--inter_node_latency need --emulate_nodes"),
])
@pytest.mark.multiworker
def test_bad_emulation_flags_are_clear_errors(tmp_path, args, message):
    code, out, err, pid = launch(tmp_path, *args, "--", sys.executable, LAUNCH_PROBE, "ok")
    assert code != 0
    assert message in err
    assert "pid=" not in out  # no worker started
    if shutil.which("ip"):
        assert namespaces_of(pid) == []


@pytest.mark.multiworker
def test_refuses_clearly_where_not_permitted(tmp_path):
    # Without `ip` on PATH (or without root) it cannot emulate: it says what
    # failed and how to run instead, exits non-zero, starts no worker.
    code, out, err, pid = launch(
        tmp_path, "--num_workers=2", "--emulate_nodes=2", "--",
        sys.executable, LAUNCH_PROBE, "ok",
        PATH=os.path.dirname(sys.executable),
    )
    assert code == 2, err
    assert "cannot emulate nodes:" in err
    assert ("`ip` (iproute2) was not found" in err) or ("need root" in err)
    assert "Run without --emulate_nodes" in err
    assert "pid=" not in out
    if shutil.which("ip"):
        assert namespaces_of(pid) == []


def test_refuses_without_root(monkeypatch):
    from tfscale.launch import netns

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netns.EmulationError, match="need root"):
        with netns.EmulatedCluster(2, 2, rate="1mbit"):
            pass


# Emulated clusters: root only.

def test_a_failing_ip_netns_add_is_named_and_nothing_is_left(
        permitted, monkeypatch, tmp_path):
    from tfscale.launch import netns

    # An `ip` first on PATH whose second `ip netns add` (node 1) fails.
    fake_ip = tmp_path / "ip"
    fake_ip.write_text(
        "#!/bin/sh\n"
        'case "$1 $2 $3" in "netns add "*-n1) echo "ip: no space left" >&2; exit 1;; esac\n'
        f'exec {shutil.which("ip")} "$@"\n')
    fake_ip.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    cluster = netns.EmulatedCluster(2, 2, rate="1mbit")
    with pytest.raises(netns.EmulationError,
                       match=r"`.*ip netns add tfscale-\S+-n1` failed: ip: no space left"):
        with cluster:
            pass
    assert namespaces_of(os.getpid()) == []  # the first node's namespace is gone


@pytest.mark.multiworker
def test_a_bad_rate_is_named_and_nothing_is_left(permitted, tmp_path):
    links = root_links()
    code, out, err, pid = launch(
        tmp_path, "--num_workers=2", "--emulate_nodes=2", "--inter_node_rate=40mbitz",
        "--", sys.executable, LAUNCH_PROBE, "ok",
    )
    assert code == 2
    assert 'illegal value for "rate": "40mbitz"' in err
    assert "Check --inter_node_rate" in err
    assert_nothing_left(pid, out, links)


@pytest.mark.multiworker
def test_each_worker_has_its_node_address_and_is_named_with_its_pid(permitted, tmp_path):
    links = root_links()
    code, out, err, pid = launch(
        tmp_path, "--num_workers=4", "--emulate_nodes=2", "--inter_node_rate=200mbit",
        "--", sys.executable, LAUNCH_PROBE, "ok",
    )
    assert code == 0, err
    configs = tf_configs(out)
    assert sorted(configs) == [0, 1, 2, 3]
    addresses = configs[0]["cluster"]["worker"]
    for index, config in configs.items():
        assert config["cluster"]["worker"] == addresses
        assert config["task"] == {"type": "worker", "index": index}
    hosts = [a.rsplit(":", 1)[0] for a in addresses]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
    assert all(h.startswith("10.213.") for h in hosts)
    assert len(set(addresses)) == 4
    # The topology is printed once, on stderr.
    assert err.count("emulating 2 node(s) x 2 worker(s)") == 1
    assert f"node 0: {hosts[0]}" in err and f"node 1: {hosts[2]}" in err
    assert "tbf rate 200mbit" in err
    # The launcher names each worker's own pid (os.getpid() inside its node)
    # and its node address.
    pids = {int(i): p for i, p in re.findall(r"^\[worker (\d+)\] pid=(\d+) ", out,
                                             re.MULTILINE)}
    assert ("tfscale-launch: launch 0 started " + ", ".join(
        f"worker {i} (slot {i}) pid {pids[i]} at {addresses[i]}" for i in range(4))
        + ".") in err.splitlines(), err
    assert_nothing_left(pid, out, links)


@pytest.mark.multiworker
def test_inter_node_link_is_rate_limited(permitted, tmp_path):
    links = root_links()
    pairs = ["2>0", "1>3", "0>1", "3>2"]  # node1->node0, node0->node1, intra, intra
    code, out, err, pid = launch(
        tmp_path, "--num_workers=4", "--emulate_nodes=2",
        f"--inter_node_rate={RATE_MBIT}mbit", "--timeout=60",
        "--", sys.executable, NETNS_PROBE, *[f"{p}:{MB4}" for p in pairs],
    )
    assert code == 0, err + out
    reports = results(tmp_path, 4)
    # Workers run in their node's namespace, not in ours.
    spaces = [r["netns"] for r in reports]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3]
    assert os.readlink("/proc/self/ns/net") not in spaces
    rate = {(s["src"], s["dst"]): s["bits_per_second"] for r in reports for s in r["sent"]}
    print("Mbit/s:", {k: round(v / 1e6, 1) for k, v in rate.items()})
    limit = RATE_MBIT * 1e6
    for inter in [(2, 0), (1, 3)]:
        assert 0.25 * limit <= rate[inter] <= 1.3 * limit, (inter, rate[inter])
    for intra in [(0, 1), (3, 2)]:
        assert rate[intra] >= 5 * limit, (intra, rate[intra])
    assert_nothing_left(pid, out, links)


@pytest.mark.multiworker
def test_three_nodes_share_a_rate_limited_bridge(permitted, tmp_path):
    links = root_links()
    code, out, err, pid = launch(
        tmp_path, "--num_workers=3", "--emulate_nodes=3",
        f"--inter_node_rate={RATE_MBIT}mbit", "--inter_node_burst=64kb", "--timeout=60",
        "--", sys.executable, NETNS_PROBE, f"0>1:{MB4}", "1>2:100000", "2>0:100000",
    )
    assert code == 0, err + out
    assert "bridge" in err
    reports = results(tmp_path, 3)
    assert len({r["host"] for r in reports}) == 3
    [through_bridge] = reports[0]["sent"]
    print("Mbit/s 0->1 via bridge:", round(through_bridge["bits_per_second"] / 1e6, 1))
    assert through_bridge["bits_per_second"] <= 1.3 * RATE_MBIT * 1e6
    assert_nothing_left(pid, out, links)


@pytest.mark.multiworker
def test_cleanup_after_a_failed_worker(permitted, tmp_path):
    links = root_links()
    code, out, err, pid = launch(
        tmp_path, "--num_workers=4", "--emulate_nodes=2", "--grace_seconds=2",
        "--", sys.executable, LAUNCH_PROBE, "fail", "2",
    )
    assert code == 3
    assert "worker 2 exited with code 3; stopped the other workers." in err
    assert_nothing_left(pid, out, links)


@pytest.mark.multiworker
def test_cleanup_after_timeout(permitted, tmp_path):
    links = root_links()
    code, out, err, pid = launch(
        tmp_path, "--num_workers=2", "--emulate_nodes=2", "--timeout=2",
        "--grace_seconds=2", "--", sys.executable, LAUNCH_PROBE, "sleep",
    )
    assert code == 124
    assert "timed out after 2 s" in err
    assert_nothing_left(pid, out, links)


@pytest.mark.multiworker
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_cleanup_after_the_launcher_is_signalled(permitted, tmp_path, signum):
    links = root_links()
    process = _start(
        tmp_path, "--num_workers=4", "--emulate_nodes=2", "--grace_seconds=2",
        "--", sys.executable, LAUNCH_PROBE, "sleep",
    )
    lines = []
    deadline = time.monotonic() + 30
    while sum("child=" in line for line in lines) < 4 and time.monotonic() < deadline:
        lines.append(process.stdout.readline())  # every worker is up and sleeping
    assert len(namespaces_of(process.pid)) == 2
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, err  # 130 Ctrl-C, 143 SIGTERM
    assert f"interrupted ({signum.name})" in err
    assert_nothing_left(process.pid, "".join(lines) + out, links)


@pytest.mark.multiworker
def test_namespaces_of_a_dead_launcher_are_removed(permitted, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"tfscale-{dead.pid}-0-n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        code, out, err, pid = launch(
            tmp_path, "--num_workers=2", "--emulate_nodes=2",
            "--", sys.executable, LAUNCH_PROBE, "ok",
        )
        assert code == 0, err
        assert stale in err and "left by a dead launcher" in err
        assert namespaces_of(dead.pid) == []
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


@pytest.mark.multiworker
def test_restarts_reuse_the_nodes_on_fresh_ports(permitted, tmp_path):
    links = root_links()
    code, out, err, pid = launch(
        tmp_path, "--num_workers=4", "--emulate_nodes=2", "--max_restarts=1",
        "--grace_seconds=2", "--", sys.executable, LAUNCH_PROBE, "flaky", "3", "1",
    )
    assert code == 0, err
    assert ("worker 3 exited with code 3; stopped the other workers; restart 1 of 1 "
            "on fresh ports.") in err
    assert err.count("emulating 2 node(s)") == 1  # the namespaces were made once
    clusters = []
    for line in out.splitlines():
        match = re.match(r"\[worker 0\] pid=\d+ tf_config=(.*)", line)
        if match:
            clusters.append(json.loads(match.group(1))["cluster"]["worker"])
    assert len(clusters) == 2
    hosts = [[a.rsplit(":", 1)[0] for a in c] for c in clusters]
    assert hosts[0] == hosts[1] == ["10.213.0.1", "10.213.0.1", "10.213.0.2", "10.213.0.2"]
    ports = [{a.rsplit(":", 1)[1] for a in c} for c in clusters]
    assert not ports[0] & ports[1], f"ports reused: {ports}"
    assert_nothing_left(pid, out, links)
