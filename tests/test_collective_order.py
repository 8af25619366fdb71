"""What each gradient bucket's collectives wait for, in the traced graph.

A bucket's all-reduce should start once its own gradients are ready, and
the buckets should run side by side where their algorithm's groups allow:
that is how communication hides behind backprop and behind the other
buckets (under "auto" each bucket's case waits for the one before it, as a
measured choice: tfscale/collectives/autotune.py). tfscale's own bookkeeping around every collective (the watchdog's
counters, the flight recorder's rows and stamps, the exposed-communication
stamps) must not add waits: a read of a counter made after the previous
collective, a row written in program order after the previous completion,
or a stamp in program order after the stamp of the last gradient each
chained the buckets one after the other (found with the timeline).

Each test traces one rank of a cluster the way `tfscale.Strategy` builds it
(the watchdog with its flight recorder around every collective) and follows
the graph's data and control edges. No collective runs.
"""

import pytest
import tensorflow as tf

from tfscale import collectives
from tfscale._private import tf_collectives
from tfscale.collectives import algorithms
from tfscale.collectives import flight_recorder
from tfscale.collectives import topology as topology_lib
from tfscale.collectives import watchdog

CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
COLLECTIVES = {"CollectiveReduceV2", "CollectiveGatherV2",
               "CollectiveBcastSendV2", "CollectiveBcastRecvV2"}
# Two tensors, one bucket each (no fusion): bucket 0 holds the second tensor
# (the last layer's gradient, ready first in backprop), bucket 1 the first.
SIZES = (300, 900)


@pytest.fixture
def bucket_ops(monkeypatch):
    """Records, for each bucket traced, the collective ops its algorithm made."""
    recorded = []
    for name, algorithm in list(algorithms.BUFFER_ALGORITHMS.items()):
        def recording(buffer, groups, num_chunks, algorithm=algorithm):
            graph = tf.compat.v1.get_default_graph()
            before = len(graph.get_operations())
            result = algorithm(buffer, groups, num_chunks)
            recorded.append([op for op in graph.get_operations()[before:]
                             if op.type in COLLECTIVES])
            return result
        monkeypatch.setitem(algorithms.BUFFER_ALGORITHMS, name, recording)
    return recorded


def trace(topology, algorithm, timed):
    """Traces one rank's all-reduce of float32 tensors of SIZES, each
    collective through a watchdog and a flight recorder as the strategy
    runs them. Returns the graph's placeholders."""
    recorder = flight_recorder.FlightRecorder(CPU, topology.rank)
    watch = watchdog.Watchdog(1e6, CPU, abort=lambda message: None,
                              poll_seconds=3600, recorder=recorder)
    try:
        world = tf_collectives.standalone_group(
            topology.num_workers, CPU, "ring",
            max_subgroup_index=collectives.topology.MAX_SUBGROUP_INDEX, watch=watch)
        exposed = tf.Variable(0.0, dtype=tf.float64) if timed else None
        all_reduce = collectives.AllReduce(
            topology, algorithm, fusion_threshold_bytes=0, implementation="ring",
            note=recorder.context, exposed_communication_seconds=exposed)
        # As Keras traces a step: without autograph (see test_nccl_graph.py).
        function = tf.function(lambda *tensors: all_reduce(list(tensors), world),
                               autograph=False)
        graph = function.get_concrete_function(
            *[tf.TensorSpec([n], tf.float32) for n in SIZES]).graph
    finally:
        watch.stop()
    return [op for op in graph.get_operations() if op.type == "Placeholder"]


def waits_for(op, earlier):
    """Whether `op` runs only after `earlier`: a path of data or control
    edges from `earlier` to `op`."""
    seen, frontier = set(), [op]
    while frontier:
        current = frontier.pop()
        if current is earlier:
            return True
        if current.name in seen:
            continue
        seen.add(current.name)
        frontier.extend(t.op for t in current.inputs)
        frontier.extend(current.control_inputs)
    return False


@pytest.mark.parametrize("algorithm,rank", [("hierarchical", 0), ("hierarchical", 1),
                                            ("2d", 0)])
def test_a_bucket_does_not_wait_for_the_previous_buckets_later_stages(
        bucket_ops, algorithm, rank):
    # 4 workers in 2 nodes of 2: the stages run on different groups, so
    # bucket 1's first stage can run while bucket 0's later stages do.
    topology = topology_lib.from_hosts(["h0", "h0", "h1", "h1"], rank, 2)
    trace(topology, algorithm, timed=False)
    first, second = bucket_ops
    assert len(first) >= 2 and second, [len(first), len(second)]
    for later_stage in first[1:]:
        assert not waits_for(second[0], later_stage), (
            f"bucket 1's first collective {second[0].name} waits for bucket 0's "
            f"{later_stage.name} ({later_stage.type})")


@pytest.mark.parametrize("timed", [False, True], ids=["untimed", "time_all_reduces"])
def test_the_first_bucket_does_not_wait_for_the_last_gradient(bucket_ops, timed):
    topology = topology_lib.from_hosts(["h0", "h0", "h1", "h1"], 0, 2)
    placeholders = trace(topology, "ring", timed=timed)
    last_gradient = placeholders[0]  # the first layer's: in the last bucket
    first_bucket = bucket_ops[0]
    assert not waits_for(first_bucket[0], last_gradient), (
        f"bucket 0's first collective {first_bucket[0].name} waits for the "
        f"last gradient's input {last_gradient.name}")
    assert waits_for(bucket_ops[1][0], last_gradient)  # the check can see a path


@pytest.mark.parametrize("timed", [False, True])
def test_auto_buckets_start_with_their_own_gradients_each_after_the_one_before(timed):
    """Under algorithm="auto" each bucket's algorithm is a `Case` over the
    candidates: bucket 0's waits only for its own tensor, and bucket 1's
    for bucket 0's, as a fixed plan's buckets follow their group's ordering
    token (4 workers in 2 nodes of 2, rank 0)."""
    topology = topology_lib.from_hosts(["h0", "h0", "h1", "h1"], 0, 2)
    placeholders = trace(topology, "auto", timed=timed)
    cases = [op for op in placeholders[0].graph.get_operations() if op.type == "Case"]
    first = [op for op in cases if waits_for(op, placeholders[1])
             and not waits_for(op, placeholders[0])]
    second = [op for op in cases if waits_for(op, placeholders[0])]
    assert len(first) == 1 and len(second) == 1, [op.name for op in cases]
    assert waits_for(second[0], first[0])


def test_auto_times_each_candidate_from_a_stamp_its_collectives_wait_for(bucket_ops):
    """Each candidate's branch returns, first, the stamp its trial time
    starts from; the stamp waits, as data inputs of the branch, for the
    bucket's tensors and the previous bucket's results, and every
    collective of the branch waits for it. So the time is the bucket's own
    case's. (A stamp outside the case, once the bucket's tensors were ready,
    is one more ready op, which the executor ran after a 64-byte bucket's
    whole case: negative times. A stamp inside that waits for them by
    control dependencies only runs with the branch index: it read times
    from about the step's start.)"""
    topology = topology_lib.from_hosts(["h0", "h0", "h1", "h1"], 0, 2)
    placeholders = trace(topology, "auto", timed=False)
    candidates = [ops for ops in bucket_ops if ops]
    # 2 buckets x (ring, hierarchical, 2d), bucket 0 (SIZES[1]) first
    assert len(candidates) == 6, [[op.name for op in ops] for ops in candidates]
    cases = {}
    for number, ops in enumerate(candidates):
        branch = ops[0].graph
        start = branch.outputs[0].op
        while start.type == "Identity" and start.inputs:
            start = start.inputs[0].op
        assert start.type == "Timestamp", start
        for op in ops:
            assert waits_for(op, start), f"{op.name} does not wait for {start.name}"
        # What the stamp waits for through data, outside the branch.
        waited = [external for external, internal in branch.captures
                  if any(waits_for(start, consumer) and consumer.type == "Identity"
                         for consumer in internal.consumers())]
        bucket = number // 3
        assert placeholders[1 - bucket].outputs[0] in waited, (bucket, waited)
        cases.setdefault(bucket, []).append(waited)
    # Bucket 1's stamp also waits for bucket 0's results.
    (case_0,) = {op for op in placeholders[0].graph.get_operations()
                 if op.type == "Case" and waits_for(op, placeholders[1])
                 and not waits_for(op, placeholders[0])}
    for waited in cases[1]:
        assert any(waits_for(tensor.op, case_0) for tensor in waited), waited
