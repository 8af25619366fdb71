"""CPU-seconds of this process and every process it started (`--cpu-durations`).

Under README's test command two pytest processes share two cores with the
workers they start, so a test's wall time says little about what it costs:
it also waits for the other process's workers. Its CPU-seconds do not. They
are this process's user and system time, those of its children it has waited
for (which include their own waited-for children), and those of every live
descendant with the same counts of theirs (Linux's /proc/PID/stat, fields
14-17), so a reused pool's workers count while they run a test's scenario.
A process that ended and was not yet waited for (a zombie) is missed.
"""

import os

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children(pid):
    """The live children of `pid` (every thread's, as /proc lists them)."""
    found = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as f:
                found += [int(child) for child in f.read().split()]
        except OSError:
            pass
    return found


def _descendants(pid):
    found, unseen = [], _children(pid)
    while unseen:
        child = unseen.pop()
        found.append(child)
        unseen += _children(child)
    return found


def _own_and_waited_for(pid):
    """utime + stime + cutime + cstime of `pid`, in seconds (0 once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The fields after the command name, which may hold spaces: the
            # state is field 3, utime field 14.
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(ticks) for ticks in fields[11:15]) / _TICKS


def process_tree():
    """CPU-seconds used so far by this process and its descendants."""
    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    return total + sum(_own_and_waited_for(pid) for pid in _descendants(os.getpid()))
