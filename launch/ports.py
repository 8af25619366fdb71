"""Free ports to hand to worker processes, without a release-then-bind race.

A port found free by binding port 0 and closing the socket is in the
kernel's ephemeral range: until the worker binds it seconds later, any
outgoing connection or bind(0) on the machine may be given the same port
(a worker then fails with "Address already in use"). Ports picked here lie
below that range (/proc/sys/net/ipv4/ip_local_port_range), which the kernel
never hands out by itself: only another program choosing that very port
could take it, and a random pick among some twenty thousand makes two
pickers meeting unlikely. tfscale-launch still relaunches every worker on
new ports when one cannot bind (local.py), for that last case.
"""

import random
import socket

# Below: ports of well-known services; the ephemeral range starts at 32768
# on Linux by default, leaving 22768 ports.
_LOWEST = 10000
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_ATTEMPTS = 200

_handed_out = set()  # never the same port twice from one process


def ephemeral_range():
    """(first, last) of the kernel's ephemeral ports, or None if unknown."""
    try:
        with open(_RANGE_FILE) as f:
            first, last = (int(word) for word in f.read().split())
    except (OSError, ValueError):
        return None
    return first, last


def _bindable(host, port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _from_kernel(host, count):
    """The fallback where the range is unknown: ports the kernel picks."""
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


def free_ports(host, count, consecutive=False):
    """`count` distinct ports on `host`, free now and outside the ephemeral
    range (or from the kernel where that range is unknown or leaves no room).

    `consecutive`: the ports are P, P + 1, ... (SLURM tasks of one node
    listen on a base port + their local rank).
    """
    known = ephemeral_range()
    if known is None or known[0] - _LOWEST < 2 * count:
        return _from_kernel(host, count)
    rng = random.SystemRandom()
    for _ in range(_ATTEMPTS):
        if consecutive:
            first = rng.randrange(_LOWEST, known[0] - count + 1)
            candidates = list(range(first, first + count))
        else:
            candidates = rng.sample(range(_LOWEST, known[0]), count)
        if not _handed_out.intersection(candidates) and all(
                _bindable(host, port) for port in candidates):
            _handed_out.update(candidates)
            return candidates
    raise OSError(f"no {count} free ports on {host} between {_LOWEST} and "
                  f"{known[0] - 1} after {_ATTEMPTS} attempts")
