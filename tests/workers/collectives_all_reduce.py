"""All-reduces known tensors with every algorithm and reports inputs and sums.

Each configuration is a `tfscale.Strategy(communication=CommunicationOptions(
...))` of its own, and its all-reduce is what Keras calls for gradients
(`ReplicaContext.all_reduce` inside `strategy.run`, in a `tf.function`). The
buffer algorithms also run alone on `strategy.collective_groups`. The test sums
the reported inputs in float64 and compares.

Flags: --local_size (workers per node).
"""

import json
import os

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import tfscale
from report import report
from tfscale.collectives import algorithms

flags.DEFINE_integer("local_size", 2, "Workers per node.")
FLAGS = flags.FLAGS

# Shapes as a model's gradients come: matrices, vectors, a scalar, one big
# enough to be split into chunks. Forward order.
SHAPES = [(3, 4), (5,), (), (7, 7, 3), (1000,), (33,)]
# Small buckets, so that each algorithm runs on several fused buffers.
FUSION_BYTES = 512
# "hybrid" with this threshold sends the small buckets hierarchically and
# the 1000-element one (4,000 bytes) by ring.
HYBRID_BYTES = 2048
# Odd length: chunks and 2d shards need padding.
BUFFER_LENGTH = 1001
# A cost model fitted on the emulated 2 x 2 cluster (pinned in tests/data).
FITTED_COST_MODEL = os.path.join(os.path.dirname(__file__), "..", "data",
                                 "cost_model_fit_emulated_2x2.json")


def integer_tensors(rank):
    """Integer-valued float32 (exact sums expected) and int32 tensors."""
    rng = np.random.default_rng(100 + rank)
    floats = [rng.integers(-1000, 1000, s).astype(np.float32) for s in SHAPES]
    ints = [rng.integers(-1000, 1000, (6,)).astype(np.int32)]
    return floats + ints


def real_tensors(rank):
    """Non-integer float32 tensors of mixed magnitudes."""
    rng = np.random.default_rng(200 + rank)
    return [
        (rng.normal(size=s) * 10.0 ** rng.integers(-6, 3, s)).astype(np.float32)
        for s in SHAPES
    ]


def to_json(arrays):
    return [np.asarray(a).astype(np.float64).ravel().tolist() for a in arrays]


def strategy_for(algorithm, compression=None):
    """A `tfscale.Strategy` configured as a user would configure it."""
    return tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm=algorithm, fusion_threshold_bytes=FUSION_BYTES,
        hybrid_threshold_bytes=HYBRID_BYTES if algorithm == "hybrid" else None,
        local_size=FLAGS.local_size, compression=compression, timeout_seconds=60))


def all_reduce_fn(strategy):
    """Sums a list of tensors as Keras sums gradients: ReplicaContext.all_reduce."""
    def replica_fn(tensors):
        # Placed on this replica's device, as gradients computed here are.
        tensors = [tf.identity(t) for t in tensors]
        return tf.distribute.get_replica_context().all_reduce("SUM", tensors)

    return tf.function(lambda tensors: strategy.run(replica_fn, args=(tensors,)))


def main(argv):
    refused = {}
    results = {"integer": {}, "real": {}, "plans": {}, "routed": {}}
    rank = None
    for name in ("ring", "hierarchical", "hybrid", "2d"):
        try:
            strategy = strategy_for(name)
        except NotImplementedError as error:
            refused[name] = str(error)
            continue
        if name == "ring":
            rank, topology = strategy.worker_index, strategy.topology
            integer_inputs = [tf.constant(t) for t in integer_tensors(rank)]
            real_inputs = [tf.constant(t) for t in real_tensors(rank)]
        if name == "hierarchical":  # world, in-node and cross-node groups
            groups = strategy.collective_groups
        fn = all_reduce_fn(strategy)
        results["plans"][name] = [
            [b.algorithm, b.size_bytes, b.num_chunks]
            for b in strategy.all_reduce_plan(integer_inputs)
        ]
        # Twice: the second call reuses the trace with fresh instance keys.
        fn(integer_inputs)
        results["integer"][name] = to_json(fn(integer_inputs))
        results["real"][name] = to_json(fn(real_inputs))
        results["routed"][name] = strategy.all_reduce_batch_sizes

    # "hybrid" without a threshold under a fitted cost model: each bucket by
    # the model's prediction (here, one 32 MiB bucket).
    with open(FITTED_COST_MODEL) as f:
        fitted = tfscale.collectives.cost_model.CostModel.from_config(
            json.load(f)["cost_model"])
    by_model = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm="hybrid", local_size=FLAGS.local_size, cost_model=fitted,
        fusion_threshold_bytes=64 << 20))
    results["plans"]["hybrid/fitted"] = [
        [b.algorithm, b.size_bytes, b.num_chunks]
        for b in by_model.all_reduce_plan([tf.zeros([8 << 20])])
    ]

    # The algorithms themselves, on one odd-length buffer split into chunks.
    buffer = tf.constant(np.random.default_rng(300 + rank).integers(
        -1000, 1000, BUFFER_LENGTH).astype(np.float32))
    chunked = {}
    for name, fn in algorithms.BUFFER_ALGORITHMS.items():
        if name in refused:
            continue
        for num_chunks in (1, 3):
            run = tf.function(lambda b, fn=fn, c=num_chunks: fn(b, groups, c))
            chunked[f"{name}/{num_chunks}"] = run(buffer).numpy().tolist()

    compressed = {}
    wires = [("hierarchical", "bfloat16"), ("hierarchical", "float16")]
    if "2d" not in refused:  # all-gathers 16-bit shards
        wires.append(("2d", "bfloat16"))
    for algorithm, compression in wires:
        key = compression if algorithm == "hierarchical" else f"{algorithm}/{compression}"
        fn = all_reduce_fn(strategy_for(algorithm, compression))
        compressed[key] = to_json(fn(real_inputs))
    # float16 with values whose 4-worker sum overflows float16 (65504) and
    # values below its smallest subnormal (6e-8).
    extreme = [tf.constant(np.array([6e4, -6e4, 1e-9, 3.0], np.float32) * (rank + 1))]
    fn = all_reduce_fn(strategy_for("ring", "float16"))
    compressed["float16/extreme"] = to_json(fn(extreme))

    report({
        "worker_index": rank,
        "nodes": [list(n) for n in topology.nodes],
        "refused": refused,
        "integer_inputs": to_json(integer_tensors(rank)),
        "real_inputs": to_json(real_tensors(rank)),
        "buffer": buffer.numpy().tolist(),
        "extreme_inputs": to_json([e.numpy() for e in extreme]),
        "chunked": chunked,
        "compressed": compressed,
        **results,
    })


if __name__ == "__main__":
    app.run(main)
