"""The worker side of `tfscale-bench fixedcost`: one process of the cluster.

A launch measures one side (see fixedcost.py):

- `"stock"`: TF's MultiWorkerMirroredStrategy all-reducing one float32 the
  way Keras does (allreduce_worker's stock case), and, on the collective
  runtime that strategy configured, bare TensorFlow collective ops in a
  `tf.function` of their own (`bare_cases`): no strategy, no Python
  between the call and the op.
- `"tfscale"`: one `tfscale.Strategy` per algorithm (allreduce_worker's
  tfscale cases), and with ring also one without the collective timeout
  (`unwatched_ring_case`): the watchdog and the flight recorder around
  each op are then left out, which measures what they cost.

Each case is warmed up and its result checked against the exact sum
(allreduce_worker.measure_case); then the cases are timed in turn, one call
each per round, after a barrier, and checked again.
"""

import time

import tensorflow as tf

import tfscale
from tfscale import agreement
from tfscale.launch.bench import allreduce_worker
from tfscale.launch.bench import cluster
from tfscale.launch.bench import stats

# Keys of the bare ops: far above those MultiWorkerMirroredStrategy counts
# from 1 (group keys) and its instance keys, so they cannot collide.
BARE_GROUP_KEY = 1 << 20
BARE_INSTANCE_KEY = 1 << 28
# Bare ops chained in one function, for the cost of one op without the call.
CHAIN_LENGTH = 10
# Row kinds: the call without a collective, bare ops, strategies' all-reduces.
FLOOR, BARE, ALL_REDUCE = "floor", "bare op", "all-reduce"


def measure(spec):
    """Measures every case of this side on this worker (as allreduce_worker)."""
    if spec["side"] == cluster.STOCK:
        cases = allreduce_worker.stock_cases(dict(spec, bytes_per_pack=0))
        cases += bare_cases(cases[0]["strategy"], cases[0]["barrier"])
    else:
        cases = allreduce_worker.tfscale_cases(spec)
        if any(config[1] == "ring" for config in spec["configs"]):
            cases.append(unwatched_ring_case(spec))
    strategy = cases[0]["strategy"]
    rank = strategy.worker_index
    shapes = [[1]]
    inputs = [tf.constant(a) for a in stats.integer_inputs(shapes, rank)]
    expected = stats.expected_sum(shapes, strategy.num_workers)
    rows, wants = [], []
    for case in cases:  # warm-up and the exactness check of each case
        kind = case.get("kind", ALL_REDUCE)
        # The floor returns this worker's input.
        wants.append([i.numpy() for i in inputs] if kind == FLOOR else expected)
        row = allreduce_worker.measure_case(case, inputs, wants[-1], dict(spec, repeats=0))
        row.update(rank=rank, kind=kind, ops_per_call=case.get("ops_per_call", None))
        rows.append(row)
        if row["wrong"]:
            return {"rank": rank, "num_workers": strategy.num_workers, "rows": rows}
    # Timed round-robin, one call of each case per round, so that every case
    # sees the same load of the shared machine.
    for _ in range(spec["repeats"]):
        for case, row in zip(cases, rows):
            case["barrier"]()
            start = time.perf_counter()
            outputs = case["fn"](inputs)
            outputs[-1].numpy()
            row["repeat_seconds"].append(time.perf_counter() - start)
    for case, row, want in zip(cases, rows, wants):  # the timed results must be right too
        row["wrong"] = stats.count_wrong([o.numpy() for o in case["fn"](inputs)], want)
    return {"rank": rank, "num_workers": strategy.num_workers, "rows": rows}


def bare_cases(strategy, barrier):
    """Bare TensorFlow collective ops on `strategy`'s workers, one float32
    (`barrier`: the strategy's, which starts each timed call).

    - "function call, no collective": the floor of calling a `tf.function`
      from Python and reading its result.
    - "CollectiveReduceV2, same key": one ring all-reduce op whose instance
      key is the same every call (TensorFlow keeps its resolved instance).
    - "CollectiveReduceV2, new key": a new instance key every call, as
      tfscale and MWMS give each op of each step (the instance is resolved
      again: its group members exchange their parameters).
    - "CollectiveGatherV2 + sum, same key": the ring all-gather, n - 1 steps
      against the all-reduce's 2 (n - 1), then a local sum.
    - "CollectiveReduceV2 x 10 chained, per op": ten ops, each on the
      previous one's result, in one function, divided by ten: one op without
      the call around it.
    """
    n = strategy.num_workers
    device = strategy.extended.worker_devices[0]
    with tf.device(device):
        new_key = tf.Variable(BARE_INSTANCE_KEY + 1000, dtype=tf.int32, trainable=False)

    def reduce(x, instance_key):
        return tf.raw_ops.CollectiveReduceV2(
            input=x, group_size=n, group_key=BARE_GROUP_KEY, instance_key=instance_key,
            ordering_token=[], merge_op="Add", final_op="Id")

    def on_device(fn):
        @tf.function
        def run(tensors):
            with tf.device(device):
                return [fn(tf.identity(tensors[0]))]
        return run

    def gather_sum(x):
        gathered = tf.raw_ops.CollectiveGatherV2(
            input=x, group_size=n, group_key=BARE_GROUP_KEY,
            instance_key=BARE_INSTANCE_KEY + 1, ordering_token=[])
        return tf.reduce_sum(tf.reshape(gathered, [n, -1]), axis=0)

    def chain(x):
        for i in range(CHAIN_LENGTH):
            # Each later op sums the previous sum: divided by n it is the
            # sum again (exact: small integers).
            x = reduce(x, BARE_INSTANCE_KEY + 10 + i)
            x = x / n if i else x
        return x

    cases = [
        ("function call, no collective", tf.identity, 1, FLOOR),
        ("CollectiveReduceV2, same key", lambda x: reduce(x, BARE_INSTANCE_KEY), 1, BARE),
        ("CollectiveReduceV2, new key", lambda x: reduce(x, new_key.assign_add(1)), 1, BARE),
        ("CollectiveGatherV2 + sum, same key", gather_sum, 1, BARE),
        (f"CollectiveReduceV2 x {CHAIN_LENGTH} chained, per op", chain, CHAIN_LENGTH, BARE),
    ]
    return [{"fn": on_device(fn), "barrier": barrier, "strategy": strategy,
             "side": cluster.STOCK, "algorithm": label, "compression": None,
             "label": label, "ops_per_call": ops, "kind": kind}
            for label, fn, ops, kind in cases]


def unwatched_ring_case(spec):
    """tfscale's ring with `timeout_seconds=None`: no watchdog counts its
    ops and no flight recorder records them."""
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm="ring", fusion_threshold_bytes=spec["fusion_threshold_bytes"],
        local_size=spec.get("local_size"), timeout_seconds=None, time_all_reduces=False))
    return {"fn": allreduce_worker.sum_across_workers(strategy),
            "barrier": agreement.barrier(strategy), "strategy": strategy,
            "side": "tfscale", "algorithm": "ring", "compression": None,
            "label": "ring, timeout_seconds=None (no watchdog, no recorder)",
            "kind": ALL_REDUCE}
