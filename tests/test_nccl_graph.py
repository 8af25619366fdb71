"""The NCCL path's graph, traced on CPU and not run: every collective of a
worker on one ordering chain across all its groups, in an order all workers
share; `communication_hint="nccl"`; no broadcast op; no bfloat16 on the wire.
And what this CPU machine resolves "auto" to.

tensorflow-cpu has no NCCL kernels, and `CommunicationOptions(
implementation="nccl")` is refused without GPUs. The seam: the collective
groups and `collectives.AllReduce` take the implementation `tfscale.Strategy`
resolved as an argument and never look for a GPU themselves. Each test traces
what every rank of a cluster would run, one rank at a time in this process,
with `tf.function(...).get_concrete_function()` (real TensorFlow collective
ops in a graph; nothing executes them).
"""

import pytest
import tensorflow as tf

import tfscale
from tfscale._private import tf_collectives
from tfscale import collectives
from tfscale.collectives import implementation
from tfscale.collectives import topology as topology_lib

CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
REDUCE, GATHER = "CollectiveReduceV2", "CollectiveGatherV2"
BROADCASTS = {"CollectiveBcastSendV2", "CollectiveBcastRecvV2"}
COLLECTIVES = {REDUCE, GATHER, *BROADCASTS}
# Elements of each tensor, forward order: reduced last layer first, they make
# three buckets at a 2,048-byte threshold (3,600, 2,200 and 28 bytes).
SIZES = (7, 250, 300, 900)


def cluster(num_workers, local_size):
    return [topology_lib.from_hosts(["h"] * num_workers, rank, local_size)
            for rank in range(num_workers)]


def trace(topology, algorithm, implementation_name, sizes=SIZES, **options):
    """The collective ops, in graph order, of one rank's all-reduce of
    float32 tensors of `sizes` elements; the `AllReduce`; its groups."""
    world = tf_collectives.standalone_group(
        topology.num_workers, CPU, implementation_name,
        max_subgroup_index=collectives.topology.MAX_SUBGROUP_INDEX)
    all_reduce = collectives.AllReduce(
        topology, algorithm, fusion_threshold_bytes=2048,
        implementation=implementation_name, **options)
    # autograph=False: as Keras traces a step (its step functions are
    # `do_not_convert`); converting the all-reduce's Python takes seconds.
    function = tf.function(lambda *tensors: all_reduce(list(tensors), world),
                           autograph=False)
    graph = function.get_concrete_function(
        *[tf.TensorSpec([n], tf.float32) for n in sizes]).graph
    ops = [op for op in graph.get_operations() if op.type in COLLECTIVES]
    return ops, all_reduce, all_reduce.groups(world)


def group_key(op):
    return int(tf.get_static_value(op.inputs[2]))


def ordering_tokens(ops):
    """Names of the ordering-token inputs of all-reduces and all-gathers."""
    return {t.name for op in ops if op.type in (REDUCE, GATHER) for t in op.inputs[4:]}


def chain(ops):
    """The ops in the order their control edges chain them.

    Fails unless each op but the first has exactly one of the others among its
    control inputs, and no op precedes two: one chain through all of them.
    """
    names = {op.name for op in ops}
    before = {op.name: sorted({c.name for c in op.control_inputs if c.name in names})
              for op in ops}
    heads = [op for op in ops if not before[op.name]]
    assert len(heads) == 1, f"{len(heads)} chains: {[h.name for h in heads]}"
    assert all(len(p) <= 1 for p in before.values()), before
    after = {p[0]: name for name, p in before.items() if p}
    assert len(after) == len(ops) - 1, "an op precedes two others"
    by_name = {op.name: op for op in ops}
    order = [heads[0]]
    while order[-1].name in after:
        order.append(by_name[after[order[-1].name]])
    assert len(order) == len(ops)
    return order


def kinds(groups):
    """Group key -> the kind of group, for readable expectations."""
    return {getattr(groups, kind).key: kind
            for kind in ("world", "intra_in", "intra_out", "cross")
            if getattr(groups, kind) is not None}


def assert_one_order_for_all(chains):
    """The chains of all ranks are parts of one order: the graph whose nodes
    are (group, n-th collective of that group) and whose edges follow each
    rank's chain has no cycle, and every member of a group issues the same
    op type as its n-th collective there."""
    edges, op_types = {}, {}
    for ops in chains:
        seen, previous = {}, None
        for op in ops:
            key = group_key(op)
            node = (key, seen.setdefault(key, 0))
            seen[key] += 1
            assert op_types.setdefault(node, op.type) == op.type, node
            edges.setdefault(node, set())
            if previous is not None:
                edges[previous].add(node)
            previous = node
    # Kahn's algorithm: every node is removed only if there is no cycle.
    incoming = {node: 0 for node in edges}
    for targets in edges.values():
        for target in targets:
            incoming[target] += 1
    ready = [node for node, count in incoming.items() if count == 0]
    removed = 0
    while ready:
        node = ready.pop()
        removed += 1
        for target in edges[node]:
            incoming[target] -= 1
            if incoming[target] == 0:
                ready.append(target)
    assert removed == len(edges), "the workers' launch orders form a cycle"


# Algorithm -> (workers, local_size): clusters where it uses sub-groups
# (halving-doubling on 3 workers folds one worker into a partner).
CLUSTERS = {"hierarchical": (4, 2), "2d": (4, 2), "hybrid": (4, 2),
            "halving_doubling": (3, 2)}


@pytest.mark.parametrize("algorithm", sorted(CLUSTERS))
def test_nccl_chains_every_collective_of_a_worker_in_one_shared_order(algorithm):
    chains, keys = [], set()
    for topology in cluster(*CLUSTERS[algorithm]):
        options = {"hybrid_threshold_bytes": 2000} if algorithm == "hybrid" else {}
        ops, _, _ = trace(topology, algorithm, "nccl", **options)
        assert ops and not [op.type for op in ops if op.type in BROADCASTS]
        assert {op.get_attr("communication_hint") for op in ops} == {b"nccl"}
        # One ordering token for all groups: automatic control dependencies
        # chain the collectives in the order they were created.
        assert len(ordering_tokens(ops)) == 1
        keys |= {group_key(op) for op in ops}
        chains.append(chain(ops))
    assert len(keys) > 1  # several groups, each its own NCCL communicator
    assert_one_order_for_all(chains)


GPU = "/job:worker/replica:0/task:1/device:GPU:0"


def default_algorithm(device, **options):
    """What `tfscale.Strategy` runs for `CommunicationOptions(**options)` on
    a worker whose device is `device`: (implementation, algorithm)."""
    communication = tfscale.CommunicationOptions(**options)
    resolved = implementation.resolve(communication.implementation, device)
    return resolved, communication.algorithm_on(resolved)


def test_the_default_on_a_gpu_is_one_nccl_all_reduce_per_bucket_over_all_workers():
    assert default_algorithm(GPU) == ("nccl", "ring")
    for topology in cluster(4, 2):  # two nodes: hybrid would use sub-groups
        ops, all_reduce, groups = trace(topology, "ring", "nccl")
        buckets = all_reduce.plan([tf.zeros([n]) for n in SIZES])
        assert len(buckets) == 3 and {b.algorithm for b in buckets} == {"ring"}
        # One all-reduce per bucket, all over the world group; NCCL's own
        # ring or tree runs inside each.
        assert [op.type for op in chain(ops)] == [REDUCE] * 3
        assert {group_key(op) for op in ops} == {groups.world.key}
        assert {op.get_attr("communication_hint") for op in ops} == {b"nccl"}


def test_the_default_on_cpu_is_auto_and_named_algorithms_stay_available():
    assert default_algorithm(CPU) == ("ring", "auto")
    assert default_algorithm(CPU, hybrid_threshold_bytes=2000) == ("ring", "hybrid")
    assert default_algorithm(GPU, hybrid_threshold_bytes=2000) == ("nccl", "hybrid")
    for name in ("hierarchical", "2d", "halving_doubling", "hybrid"):
        assert default_algorithm(GPU, algorithm=name) == ("nccl", name)


def test_nccl_hierarchical_order_on_a_leader_and_a_member():
    leader, member = cluster(4, 2)[:2]
    expected = {
        # Per bucket: reduce in the node, between leaders, then the
        # broadcast, an all-reduce to which the leader alone contributes.
        leader: [("intra_in", REDUCE), ("cross", REDUCE), ("intra_out", REDUCE)],
        member: [("intra_in", REDUCE), ("intra_out", REDUCE)],
    }
    for topology, per_bucket in expected.items():
        ops, all_reduce, groups = trace(topology, "hierarchical", "nccl")
        assert len(all_reduce.plan([tf.zeros([n]) for n in SIZES])) == 3
        names = kinds(groups)
        assert [(names[group_key(op)], op.type) for op in chain(ops)] == per_bucket * 3


def test_ring_path_keeps_a_token_per_group_and_its_broadcasts():
    leader = cluster(4, 2)[0]
    ops, _, _ = trace(leader, "hierarchical", "ring")
    assert {op.type for op in ops} == {REDUCE, "CollectiveBcastSendV2"}
    assert {op.get_attr("communication_hint") for op in ops} == {b"ring", b"auto"}
    # intra_in and cross each order only their own: two tokens, and the
    # chain check above would find several chains.
    assert len(ordering_tokens(ops)) == 2
    with pytest.raises(AssertionError, match="chains"):
        chain([op for op in ops if op.type == REDUCE])


def test_nccl_sends_bfloat16_compression_as_scaled_float16():
    leader = cluster(4, 2)[0]
    ops, all_reduce, _ = trace(leader, "hierarchical", "nccl", compression="bfloat16")
    assert all_reduce.compression == "float16"
    wire = {op.inputs[0].dtype for op in ops}
    assert wire == {tf.float16, tf.float32}  # float32: the scale's maximum
    maxima = [op for op in ops if op.get_attr("merge_op") == b"Max"]
    assert len(maxima) == 3  # one per bucket, on the chain like the rest
    assert len(chain(ops)) == len(ops)


def test_nccl_sends_each_bucket_whole():
    big = [tf.zeros([16 << 20])]  # 64 MiB: the ring path pipelines it
    leader = cluster(4, 2)[0]
    ring = collectives.AllReduce(leader, "2d", 64 << 20)
    nccl = collectives.AllReduce(leader, "2d", 64 << 20, implementation="nccl")
    assert ring.plan(big)[0].num_chunks > 1
    assert nccl.plan(big)[0].num_chunks == 1


def test_nccl_refuses_bfloat16_collectives_when_traced():
    world = tf_collectives.standalone_group(2, CPU, "nccl")
    function = tf.function(lambda x: world.all_reduce(x))
    with pytest.raises(ValueError, match=(
            r"NCCL cannot sum bfloat16 \(it sums float16, float32, float64, int32, "
            r"int64\): cast to float32 first, or use implementation='ring'.")):
        function.get_concrete_function(tf.TensorSpec([4], tf.bfloat16))


def test_auto_resolves_to_nccl_on_a_gpu_and_to_ring_on_a_cpu():
    assert implementation.resolve("auto", "/job:worker/replica:0/task:1/device:GPU:0") == "nccl"
    assert implementation.resolve("auto", CPU) == "ring"


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                    reason="a strategy here would run on this machine's GPU, "
                    "where auto resolves to NCCL")
def test_a_strategy_on_this_cpu_machine_resolves_auto_to_ring():
    strategy = tfscale.Strategy()  # one worker, implementation="auto"
    assert strategy.communication.implementation == "auto"
    assert strategy.communication_implementation == "ring"
    assert strategy.collective_group.implementation == "ring"
