r"""An emulated multi-node cluster on one machine, for `tfscale-launch --emulate_nodes`.

Each emulated node is a network namespace with its own address (10.213.0.K+1
in a /24 that exists only inside the namespaces made here: they get no route
to anywhere else, so no traffic can leave them). Workers of one node talk over
that namespace's loopback; traffic between nodes crosses veth links that
`tc ... tbf` rate-limits in both directions (netem is not available here).

    with EmulatedCluster(num_nodes=2, workers_per_node=2, rate="200mbit") as c:
        for worker in c.workers:
            subprocess.Popen(worker.prefix + command)  # TF_CONFIG: worker.address

Topology: 2 nodes are joined by one veth pair; 3 or more by one veth pair per
node to a bridge in a separate "switch" namespace. Nothing is created in the
root namespace, so launches cannot collide on interface names or addresses and
removing the namespaces removes every link. Needs root and iproute2.
"""

import contextlib
import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

PREFIX = "tfscale-"
SUBNET = "10.213.0"  # node K is SUBNET.(K+1)
MAX_NODES = 250
# Below the default ephemeral range (32768-60999), so no outgoing connection
# of a worker can take a port another worker listens on.
BASE_PORT = 20000
DEFAULT_BURST = "256kb"
DEFAULT_LATENCY = "500ms"

# Names: tfscale-<launcher pid>-<sequence>-n<K> (nodes) and ...-sw (switch).
# The pid is what lets a later launch recognise leftovers of a dead launcher.
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-\d+-(?:n\d+|sw)$")
_sequence = itertools.count()


class EmulationError(RuntimeError):
    """The emulated cluster cannot be set up here (permissions, tools)."""


class LinkSettingsError(EmulationError):
    """tc refused the link's rate/burst/latency (e.g. a malformed rate)."""


@dataclasses.dataclass(frozen=True)
class Worker:
    index: int
    node: int
    host: str
    port: int
    netns: str
    prefix: tuple  # run the worker's command as prefix + command

    @property
    def address(self):
        return f"{self.host}:{self.port}"


def _ip():
    return shutil.which("ip")


def _run(*args, check=True):
    """Runs one iproute2 command; EmulationError naming it if it fails."""
    try:
        done = subprocess.run(
            args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EmulationError(f"`{' '.join(args)}` failed: {error}") from None
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise EmulationError(f"`{' '.join(args)}` failed: {detail}")
    return done


def check_permitted(need_tc=True):
    """Raises EmulationError saying why namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise EmulationError(
            f"network namespaces need root (running as uid {os.geteuid()})"
        )
    if _ip() is None:
        raise EmulationError("`ip` (iproute2) was not found on PATH")
    if need_tc and shutil.which("tc") is None:
        raise EmulationError("`tc` (iproute2) was not found on PATH")


def list_namespaces():
    if _ip() is None:
        return []
    done = _run(_ip(), "netns", "list", check=False)
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove_stale():
    """Best effort: deletes namespaces left by launchers that died without
    cleaning up (e.g. SIGKILL). Returns the names removed. A namespace whose
    launcher pid is alive (or was reused) is left alone."""
    removed = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        if _run(_ip(), "netns", "delete", name, check=False).returncode == 0:
            removed.append(name)
    return removed


@contextlib.contextmanager
def _signals_deferred():
    """Holds SIGINT/SIGTERM until the block is done, then delivers them: an
    interrupted setup or teardown is exactly what would leave namespaces behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # None: a handler not installed from Python; the default is closest.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)  # e.g. raises KeyboardInterrupt here
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


class EmulatedCluster:
    """M emulated nodes x K workers; consecutive workers share a node.

    `rate` (a tc rate such as "200mbit"; None: not limited), `burst` and
    `latency` are tbf's parameters, applied on both ends of every node's link.
    Entering creates the namespaces and links (cleaning up after itself if that
    fails or is interrupted); leaving deletes them. `workers` lists each
    worker's address (host:port) and command prefix (`ip netns exec NS`).
    """

    def __init__(self, num_nodes, workers_per_node, rate=None,
                 burst=DEFAULT_BURST, latency=DEFAULT_LATENCY, base_port=BASE_PORT):
        if not 1 <= num_nodes <= MAX_NODES:
            raise ValueError(f"num_nodes must be in 1..{MAX_NODES}, got {num_nodes}")
        if workers_per_node < 1:
            raise ValueError(f"workers_per_node must be >= 1, got {workers_per_node}")
        self.num_nodes = num_nodes
        self.workers_per_node = workers_per_node
        self.rate, self.burst, self.latency = rate, burst, latency
        self.name = f"{PREFIX}{os.getpid()}-{next(_sequence)}"
        self.nodes = [f"{self.name}-n{k}" for k in range(num_nodes)]
        self.hosts = [f"{SUBNET}.{k + 1}" for k in range(num_nodes)]
        self.switch = f"{self.name}-sw" if num_nodes > 2 else None
        self.stale_removed = []
        self.workers = []
        ip = _ip() or "ip"
        for index in range(num_nodes * workers_per_node):
            node = index // workers_per_node
            self.workers.append(Worker(
                index=index, node=node, host=self.hosts[node],
                port=base_port + index, netns=self.nodes[node],
                prefix=(ip, "netns", "exec", self.nodes[node]),
            ))

    @property
    def namespaces(self):
        return self.nodes + ([self.switch] if self.switch else [])

    def __enter__(self):
        check_permitted(need_tc=self.rate is not None and self.num_nodes > 1)
        self.stale_removed = remove_stale()
        try:
            with _signals_deferred():
                self._create()
        except BaseException:
            self._destroy()
            raise
        return self

    def __exit__(self, *exc_info):
        self._destroy()
        return False

    def _tbf(self, netns, dev):
        if self.rate is None:
            return
        try:
            _run("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", self.rate, "burst", self.burst, "latency", self.latency)
        except EmulationError as error:
            raise LinkSettingsError(str(error)) from None

    def _create(self):
        ip = _ip()
        for netns in self.namespaces:
            _run(ip, "netns", "add", netns)
            _run(ip, "-n", netns, "link", "set", "lo", "up")
        if self.num_nodes == 1:
            # No link to emulate: the node's address lives on its loopback.
            _run(ip, "-n", self.nodes[0], "addr", "add", f"{self.hosts[0]}/32", "dev", "lo")
            return
        if self.num_nodes == 2:
            # One veth pair, one end in each node (created there directly, so
            # its names never exist in the root namespace).
            _run(ip, "link", "add", "veth0", "netns", self.nodes[0], "type", "veth",
                 "peer", "name", "veth0", "netns", self.nodes[1])
        else:
            # A bridge in the switch namespace; each node's veth0 is plugged
            # into port pK, rate-limited on the switch side too (bridge->node).
            _run(ip, "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run(ip, "-n", self.switch, "link", "set", "br0", "up")
            for k, netns in enumerate(self.nodes):
                _run(ip, "link", "add", "veth0", "netns", netns, "type", "veth",
                     "peer", "name", f"p{k}", "netns", self.switch)
                _run(ip, "-n", self.switch, "link", "set", f"p{k}", "master", "br0", "up")
                self._tbf(self.switch, f"p{k}")
        for netns, host in zip(self.nodes, self.hosts):
            # Only the /24's connected route: no default route, nothing leaves.
            _run(ip, "-n", netns, "addr", "add", f"{host}/24", "dev", "veth0")
            _run(ip, "-n", netns, "link", "set", "veth0", "up")
            self._tbf(netns, "veth0")  # node -> other nodes

    def _destroy(self):
        """Deletes this cluster's namespaces; their veths and bridge go with
        them. Errors other than "already gone" are reported, not raised."""
        with _signals_deferred():
            existing = set(list_namespaces())
            for netns in self.namespaces:
                if netns not in existing:
                    continue
                done = _run(_ip(), "netns", "delete", netns, check=False)
                if done.returncode != 0:
                    print(f"tfscale-launch: could not delete network namespace "
                          f"{netns}: {done.stderr.strip()}", file=sys.stderr)

    def describe(self):
        """The topology, for the launcher to print once."""
        lines = [f"emulating {self.num_nodes} node(s) x {self.workers_per_node} "
                 f"worker(s), one network namespace per node:"]
        for k, (netns, host) in enumerate(zip(self.nodes, self.hosts)):
            ids = [str(w.index) for w in self.workers if w.node == k]
            lines.append(f"  node {k}: {host} (netns {netns}) workers {','.join(ids)}")
        if self.num_nodes == 1:
            lines.append("  no inter-node link")
        else:
            link = ("one veth pair" if self.num_nodes == 2
                    else f"a veth per node to a bridge (netns {self.switch})")
            limit = (f"tbf rate {self.rate} burst {self.burst} latency {self.latency} "
                     "in each direction" if self.rate else "not rate limited")
            lines.append(f"  inter-node link: {link}, {limit}; "
                         "same-node traffic stays on loopback")
        return "\n".join(lines)
