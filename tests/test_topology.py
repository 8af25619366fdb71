"""tfscale.collectives.topology: nodes from hosts or local_size, sub-group keys."""

import itertools
import re

import pytest

from tfscale.collectives import topology


def test_workers_on_one_host_form_a_node():
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    topo = topology.from_hosts(hosts, rank=2)
    assert topo.nodes == ((0, 1), (2, 3))
    assert (topo.node_index, topo.local_rank, topo.local_size) == (1, 0, 2)
    assert topo.is_leader and topo.leaders == (0, 2)
    assert topo.describe() == "4 workers in 2 nodes of 2"


def test_hosts_need_not_be_contiguous_in_the_worker_list():
    topo = topology.from_hosts(["a", "b", "a", "b"], rank=3)
    assert topo.nodes == ((0, 2), (1, 3))
    assert (topo.node_index, topo.local_rank) == (1, 1)


def test_local_size_overrides_hosts():
    topo = topology.from_hosts(["127.0.0.1"] * 4, rank=1, local_size=2)
    assert topo.nodes == ((0, 1), (2, 3))
    assert not topo.is_flat


def test_local_size_that_does_not_divide_leaves_a_smaller_last_node():
    topo = topology.from_hosts(["h"] * 3, rank=2, local_size=2)
    assert topo.nodes == ((0, 1), (2,))
    assert not topo.equal_nodes
    assert topo.describe() == "3 workers in 2 nodes of sizes [2, 1]"


@pytest.mark.parametrize("hosts,local_size", [
    (["h"] * 4, None),        # one node
    (["h"] * 4, 8),           # local_size beyond the workers: one node
    (["a", "b", "c"], None),  # one worker per node
    (["h"] * 3, 1),
    ([], None),               # no cluster: one worker
])
def test_one_node_or_one_worker_per_node_is_flat(hosts, local_size):
    assert topology.from_hosts(hosts, rank=0, local_size=local_size).is_flat


def test_cluster_spec_ranks_the_chief_first():
    spec = {"chief": ["a:1"], "worker": ["a:2", "b:1", "b:2"], "ps": ["c:1"]}
    assert topology.rank_in_cluster(spec, "chief", 0) == 0
    assert topology.rank_in_cluster(spec, "worker", 0) == 1
    topo = topology.from_cluster_spec(spec, rank=3)
    assert topo.nodes == ((0, 1), (2, 3))
    assert topology.rank_in_cluster({}, None, 0) == 0
    with pytest.raises(ValueError, match=re.escape(
            "Only `chief` and `worker` tasks take part in all-reduce. "
            "Received: task_type='ps'")):
        topology.rank_in_cluster(spec, "ps", 0)


def test_host_is_the_address_without_its_port():
    assert topology.split_host_port("node-3.cluster:2222") == "node-3.cluster"
    assert topology.split_host_port("[::1]:2222") == "::1"
    assert topology.split_host_port("localhost") == "localhost"


def test_bad_local_size_and_nodes_are_refused():
    with pytest.raises(ValueError, match=re.escape(
            "Argument `local_size` must be an integer >= 1, or None. "
            "Received: local_size=0")):
        topology.from_hosts(["h"] * 2, rank=0, local_size=0)
    with pytest.raises(ValueError, match=re.escape(
            "Received: nodes=((0, 1), (1, 2))")):
        topology.Topology(nodes=((0, 1), (1, 2)), rank=0)
    with pytest.raises(ValueError, match=re.escape(
            "Argument `rank` must be in 0..1. Received: rank=5")):
        topology.Topology(nodes=((0, 1),), rank=5)


@pytest.mark.parametrize("hosts,local_size", [
    (["h"] * 4, 2), (["h"] * 3, 2), (["h"] * 8, 4), (["h"] * 7, 3),
    (["a", "b", "a", "b", "c", "c"], None),
])
def test_subgroup_indices_agree_among_members_and_differ_between_groups(
        hosts, local_size):
    """Every worker computes its own indices; members of one group must get
    the same index and size, different member sets different indices."""
    members = {}  # (kind, index) -> set of ranks
    sizes = {}
    for rank in range(len(hosts)):
        topo = topology.from_hosts(hosts, rank=rank, local_size=local_size)
        for kind, (index, size) in topology.subgroup_indices(topo).items():
            assert index >= 1
            members.setdefault((kind, index), set()).add(rank)
            sizes.setdefault((kind, index), set()).add(size)
    for key, ranks in members.items():
        assert sizes[key] == {len(ranks)}, key
    indices = [index for _, index in members]
    assert len(indices) == len(set(indices))  # one index, one member set
    # Each node's workers share intra groups; leaders share one cross group.
    topo = topology.from_hosts(hosts, rank=0, local_size=local_size)
    for node in topo.nodes:
        if len(node) > 1:
            assert set(node) in [r for (k, _), r in members.items() if k == "intra_in"]
            assert set(node) in [r for (k, _), r in members.items() if k == "intra_out"]
    assert set(topo.leaders) in [r for (k, _), r in members.items() if k == "cross"]


def test_workers_alone_in_their_node_have_no_intra_groups():
    topo = topology.from_hosts(["h"] * 3, rank=2, local_size=2)
    groups = topology.subgroup_indices(topo)
    assert set(groups) == {"cross"} and groups["cross"][1] == 2
    # Rank 1 has no peer with local rank 1 in the other node.
    topo = topology.from_hosts(["h"] * 3, rank=1, local_size=2)
    assert set(topology.subgroup_indices(topo)) == {"intra_in", "intra_out"}


def test_every_rank_appears_once_in_the_topology():
    for hosts in itertools.permutations(["a", "a", "b", "c"]):
        topo = topology.from_hosts(list(hosts), rank=0)
        assert sorted(r for node in topo.nodes for r in node) == [0, 1, 2, 3]
