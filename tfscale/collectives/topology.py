"""Topology: which workers share a node, and the collective groups that follow.

A node is the set of workers that talk over a fast local link (one machine's
GPUs over NVLink/PCIe, or processes sharing memory); nodes talk over the
network. Hierarchical all-reduce keeps most steps inside nodes and sends only
one stream per node across the network (Jia et al. 2018, section 4.2).

Workers are numbered by their rank in the collective group of all workers:
TF_CONFIG's `chief` job first (if any), then its `worker` job, in list order,
as MultiWorkerMirroredStrategy numbers them.
"""

import dataclasses

from tfscale._validation import is_int


@dataclasses.dataclass(frozen=True)
class Topology:
    """Workers grouped into nodes, seen from one worker.

    Attributes:
        nodes: the ranks of each node's workers, ascending; nodes are ordered
            by their lowest rank. Every rank in `range(num_workers)` appears
            exactly once.
        rank: this worker's rank.
    """

    nodes: tuple
    rank: int

    def __post_init__(self):
        nodes = tuple(tuple(node) for node in self.nodes)
        object.__setattr__(self, "nodes", nodes)
        ranks = sorted(r for node in nodes for r in node)
        if not nodes or any(not node for node in nodes) or ranks != list(
            range(len(ranks))
        ):
            raise ValueError(
                "Argument `nodes` must be non-empty groups that together hold "
                "each rank 0..n-1 exactly once. "
                f"Received: nodes={self.nodes!r}"
            )
        if any(list(node) != sorted(node) for node in nodes) or [
            node[0] for node in nodes
        ] != sorted(node[0] for node in nodes):
            raise ValueError(
                "Argument `nodes` must list ranks ascending within each node "
                "and nodes by their lowest rank. "
                f"Received: nodes={self.nodes!r}"
            )
        if self.rank not in ranks:
            raise ValueError(
                f"Argument `rank` must be in 0..{len(ranks) - 1}. "
                f"Received: rank={self.rank!r}"
            )

    @property
    def num_workers(self):
        return sum(len(node) for node in self.nodes)

    @property
    def num_nodes(self):
        return len(self.nodes)

    @property
    def node_sizes(self):
        return tuple(len(node) for node in self.nodes)

    @property
    def equal_nodes(self):
        """Whether every node has the same number of workers."""
        return len(set(self.node_sizes)) == 1

    @property
    def node_index(self):
        """Index of this worker's node in `nodes`."""
        return next(i for i, node in enumerate(self.nodes) if self.rank in node)

    @property
    def node(self):
        """Ranks of this worker's node."""
        return self.nodes[self.node_index]

    @property
    def local_rank(self):
        """This worker's index within its node; 0 is the node's leader."""
        return self.node.index(self.rank)

    @property
    def local_size(self):
        """Number of workers in this worker's node."""
        return len(self.node)

    @property
    def leaders(self):
        """The rank of each node's leader (its lowest rank)."""
        return tuple(node[0] for node in self.nodes)

    @property
    def is_leader(self):
        return self.local_rank == 0

    @property
    def is_flat(self):
        """Whether there is no hierarchy to exploit: one node, or one worker
        per node. Hierarchical algorithms degrade to a ring then."""
        return self.num_nodes == 1 or self.num_nodes == self.num_workers

    def peers(self, local_rank):
        """Ranks holding `local_rank` in each node (nodes that have one)."""
        return tuple(node[local_rank] for node in self.nodes if local_rank < len(node))

    def describe(self):
        """A one-line summary for logs, e.g. "4 workers in 2 nodes of 2"."""
        sizes = self.node_sizes
        if self.equal_nodes:
            shape = f"{len(sizes)} node{'s' if len(sizes) > 1 else ''} of {sizes[0]}"
        else:
            shape = f"{len(sizes)} nodes of sizes {list(sizes)}"
        return f"{self.num_workers} worker{'s' if self.num_workers > 1 else ''} in {shape}"


# Sub-group indices. Each group of workers that runs collectives of its own
# needs a group key that all its members agree on and that no other group
# uses. They are numbered from the topology alone, so every worker computes
# the same numbers without talking to the others.
def subgroup_indices(topology):
    """The sub-groups this worker belongs to, with their cluster-wide indices.

    Three kinds of sub-group exist (nodes of one worker have no intra-node
    groups; an index is never reused between two different member sets):

    - `intra_in`: the workers of one node; runs the first, reducing stage.
    - `intra_out`: the same workers under another key; runs the last stage
      (broadcast or all-gather). A key of its own gives it its own ordering,
      so bucket b+1's first stage need not wait for bucket b's last.
    - `cross`: the workers with the same local rank in every node (local rank
      0: the node leaders); runs the stage between nodes.

    Args:
        topology: a `Topology`.

    Returns:
        A dict from kind (`"intra_in"`, `"intra_out"`, `"cross"`) to
        `(index, size)`, with index >= 1, for the groups this worker is in.
    """
    num_nodes = topology.num_nodes
    groups = {}
    if topology.local_size > 1:
        groups["intra_in"] = (1 + topology.node_index, topology.local_size)
        groups["intra_out"] = (1 + num_nodes + topology.node_index, topology.local_size)
    cross = topology.peers(topology.local_rank)
    if len(cross) > 1:
        groups["cross"] = (1 + 2 * num_nodes + topology.local_rank, len(cross))
    return groups


def split_host_port(address):
    """`"host:port"` -> `"host"`; IPv6 `"[::1]:port"` -> `"::1"`."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def worker_addresses(cluster_spec):
    """The addresses of the collective group's members, in rank order.

    Args:
        cluster_spec: `{job: [address, ...]}`, as in TF_CONFIG's `cluster`.

    Returns:
        The `chief` job's addresses, then the `worker` job's. Other jobs
        (`ps`, `evaluator`) take no part in all-reduce.
    """
    return list(cluster_spec.get("chief", [])) + list(cluster_spec.get("worker", []))


def rank_in_cluster(cluster_spec, task_type, task_id):
    """This worker's rank (see `worker_addresses`) from its TF_CONFIG task."""
    if not cluster_spec:
        return 0
    if task_type == "chief":
        return task_id
    if task_type == "worker":
        return len(cluster_spec.get("chief", [])) + task_id
    raise ValueError(
        "Only `chief` and `worker` tasks take part in all-reduce. "
        f"Received: task_type={task_type!r}"
    )


def from_hosts(hosts, rank, local_size=None):
    """Groups workers into nodes, by host or by a fixed node size.

    Args:
        hosts: the host of each worker, in rank order (as written in
            TF_CONFIG: "localhost" and "127.0.0.1" are different hosts).
        rank: this worker's rank.
        local_size: workers per node. `None`: workers on the same host form a
            node. Otherwise consecutive ranks are cut into nodes of
            `local_size` workers; when it does not divide the number of
            workers, the last node is smaller (e.g. 3 workers with
            `local_size=2` are nodes of 2 and 1). One node holds all workers
            when `local_size` is at least their number.

    Returns:
        A `Topology`.
    """
    num_workers = len(hosts)
    if num_workers == 0:
        # No cluster: this worker trains alone.
        return Topology(nodes=((0,),), rank=0)
    if local_size is None:
        by_host = {}
        for r, host in enumerate(hosts):
            by_host.setdefault(host, []).append(r)
        nodes = sorted(by_host.values(), key=lambda node: node[0])
    else:
        if not is_int(local_size) or local_size < 1:
            raise ValueError(
                "Argument `local_size` must be an integer >= 1, or None. "
                f"Received: local_size={local_size!r}"
            )
        nodes = [
            list(range(start, min(start + local_size, num_workers)))
            for start in range(0, num_workers, local_size)
        ]
    return Topology(nodes=tuple(tuple(n) for n in nodes), rank=rank)


def from_cluster_spec(cluster_spec, rank, local_size=None):
    """`from_hosts` for a TF_CONFIG-style cluster spec.

    Args:
        cluster_spec: `{job: [address, ...]}`; `{}` for a single worker.
        rank: this worker's rank (see `worker_addresses`).
        local_size: see `from_hosts`.
    """
    hosts = [split_host_port(a) for a in worker_addresses(cluster_spec)]
    return from_hosts(hosts, rank if hosts else 0, local_size=local_size)
