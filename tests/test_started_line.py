"""tfscale-launch's `launch R started ...` line, as the tests that kill a
worker read it (multiworker.started_pid): the right slot and launch among
neighbours whose numbers share digits."""

from multiworker import started_pid
from tfscale.launch import local


def launcher_output():
    slots = list(range(13))
    addresses = [f"127.0.0.1:{20480 + slot}" for slot in slots]
    lines = []
    for restart in (1, 12):
        pids = [1000 * restart + slot for slot in slots]
        lines.append("tfscale-launch: " + local.started_line(restart, slots, pids, addresses))
    return "\n".join(lines) + "\n"


def test_the_pid_of_each_slot_and_launch_is_found_and_no_other():
    output = launcher_output()
    assert started_pid(output, slot=1, restart=1) == 1001
    assert started_pid(output, slot=12, restart=1) == 1012
    assert started_pid(output, slot=1, restart=12) == 12001
    assert started_pid(output, slot=13, restart=1) is None
    assert started_pid(output, slot=1, restart=2) is None


def test_a_relaunch_on_fresh_ports_names_the_live_workers():
    first = "tfscale-launch: " + local.started_line(0, [0, 1], [11, 12], ["a:1", "a:2"])
    again = "tfscale-launch: " + local.started_line(0, [0, 1], [21, 22], ["a:3", "a:4"])
    assert started_pid(f"{first}\n{again}\n", slot=1) == 22


def test_the_line_names_index_slot_pid_and_address_of_each_worker():
    assert local.started_line(2, [0, 2], [4211, 4212], ["10.0.0.1:2222", "10.0.0.2:2222"]) == (
        "launch 2 started worker 0 (slot 0) pid 4211 at 10.0.0.1:2222, "
        "worker 1 (slot 2) pid 4212 at 10.0.0.2:2222.")
