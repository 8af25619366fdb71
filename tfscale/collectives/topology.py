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


# The highest sub-group index a strategy's collective keys leave room for
# (tfscale._private.tf_collectives spaces the strategies of a process by it).
MAX_SUBGROUP_INDEX = 98_999


@dataclasses.dataclass(frozen=True)
class HalvingDoubling:
    """Who exchanges with whom in recursive halving-doubling all-reduce.

    With p = 2^k + r workers (0 <= r < 2^k), as MPICH's allreduce does it
    (pmodels/mpich, src/mpi/coll/allreduce/
    allreduce_intra_reduce_scatter_allgather.c; Thakur, Rabenseifner and Gropp
    2005): the first r even ranks fold their buffer into the next odd rank,
    and the remaining 2^k workers, numbered 0..2^k-1 in rank order, halve and
    double among themselves.

    Attributes:
        num_workers: p.
        folds: `(extra, partner)` rank pairs, `(2i, 2i + 1)` for i < r: the
            extra sends its buffer to its partner first and receives the sum
            from it last.
        steps: for each of the k halving steps, the `(lower, upper)` rank
            pairs that exchange; `lower` keeps the lower half of its current
            segment, `upper` the upper half. Step s pairs the workers whose
            numbers differ in bit s (distance 2^s first, as MPICH and Gloo's
            `AllreduceHalvingDoubling` do): the largest messages go between the
            nearest ranks, in one node when nodes hold consecutive ranks. The
            doubling steps are the same pairs in reverse order.
    """

    num_workers: int
    folds: tuple
    steps: tuple

    def pairs(self):
        """Every pair that exchanges, folds first: one sub-group each."""
        return self.folds + tuple(pair for step in self.steps for pair in step)

    def role(self, rank):
        """`(fold_partner, is_extra, steps)` of one worker.

        `fold_partner` is `None` when the worker takes no part in a fold;
        `is_extra` says whether it is the one that folds (and then takes no
        part in `steps`, which is empty); `steps` lists, per halving step,
        `(partner, keeps_lower)`.
        """
        for extra, partner in self.folds:
            if rank == extra:
                return partner, True, ()
        fold_partner = next((e for e, p in self.folds if p == rank), None)
        steps = []
        for step in self.steps:
            for lower, upper in step:
                if rank in (lower, upper):
                    steps.append((upper, True) if rank == lower else (lower, False))
        return fold_partner, False, tuple(steps)


def halving_doubling(num_workers):
    """The `HalvingDoubling` schedule of `num_workers` workers."""
    if not is_int(num_workers) or num_workers < 1:
        raise ValueError(
            "Argument `num_workers` must be an integer >= 1. "
            f"Received: num_workers={num_workers!r}"
        )
    k = num_workers.bit_length() - 1
    power = 1 << k
    extra = num_workers - power

    def rank_of(number):  # number among the 2^k -> rank (MPICH's newrank)
        return 2 * number + 1 if number < extra else number + extra

    steps = tuple(
        tuple(
            (rank_of(a), rank_of(a | 1 << s)) for a in range(power) if not a & 1 << s
        )
        for s in range(k)
    )
    folds = tuple((2 * i, 2 * i + 1) for i in range(extra))
    return HalvingDoubling(num_workers=num_workers, folds=folds, steps=steps)


def _first_pair_index(topology):
    # After every index `subgroup_indices` can hand out.
    return 1 + 2 * topology.num_nodes + max(topology.node_sizes)


def halving_doubling_fits(topology):
    """Whether every halving-doubling pair gets a sub-group index (a
    strategy's collective keys run out at about 8,000 workers)."""
    n = topology.num_workers
    k = n.bit_length() - 1
    num_pairs = (n - (1 << k)) + k * (1 << k) // 2
    return _first_pair_index(topology) + num_pairs - 1 <= MAX_SUBGROUP_INDEX


def pair_subgroup_indices(topology):
    """This worker's halving-doubling pair sub-groups: `{partner rank: index}`.

    Every pair of `halving_doubling(n).pairs()` gets an index of its own,
    after the indices `subgroup_indices` can hand out, so that each pair's
    group key is the same on both partners and unique in the cluster. Check
    `halving_doubling_fits` first.
    """
    pairs = halving_doubling(topology.num_workers).pairs()
    return {
        (b if a == topology.rank else a): index
        for index, (a, b) in enumerate(pairs, start=_first_pair_index(topology))
        if topology.rank in (a, b)
    }


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
