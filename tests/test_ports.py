"""launch/ports.py: ports for workers, below the kernel's ephemeral range."""

import socket

import pytest

from tfscale.launch import ports


def _ephemeral_or_skip():
    known = ports.ephemeral_range()
    if known is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here: "
                    "free_ports falls back to the kernel's ports")
    return known


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    first, _ = _ephemeral_or_skip()
    picked = ports.free_ports("127.0.0.1", 16)
    assert len(set(picked)) == 16
    assert all(10000 <= port < first for port in picked), picked
    for port in picked:
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_consecutive_ports_follow_each_other():
    _ephemeral_or_skip()
    picked = ports.free_ports("127.0.0.1", 3, consecutive=True)
    assert picked == list(range(picked[0], picked[0] + 3))


def test_a_port_is_never_handed_out_twice_by_one_process():
    _ephemeral_or_skip()
    seen = set()
    for _ in range(50):
        picked = ports.free_ports("127.0.0.1", 4)
        assert not seen.intersection(picked)
        seen.update(picked)


def test_a_port_in_use_is_not_handed_out():
    first, _ = _ephemeral_or_skip()
    # Hold every port of a small window, then ask for ports only there.
    held = []
    try:
        for port in range(10000, 10010):
            try:
                held.append(socket.create_server(("127.0.0.1", port)))
            except OSError:
                pass  # in use already: just as good
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ports, "ephemeral_range", lambda: (10010, first))
            with pytest.raises(OSError, match="no 1 free ports on 127.0.0.1 "
                                              "between 10000 and 10009"):
                ports.free_ports("127.0.0.1", 1)
    finally:
        for server in held:
            server.close()
