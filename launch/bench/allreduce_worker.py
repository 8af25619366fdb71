"""The worker side of `tfscale-bench allreduce`: one process of the cluster.

allreduce.py writes a spec (JSON) and starts N of these through tfscale-launch;
each runs `measure(spec)` (through worker.py, which writes the result to
`<out_prefix>-<rank>.json`). A launch measures one side:

- `"stock"`: `tfscale.strategy.KerasMultiWorkerMirroredStrategy`, which is
  TF's MultiWorkerMirroredStrategy with its own all-reduce (tfscale only
  fixes Keras 3's `reduce`, which this does not call).
- `"tfscale"`: one `tfscale.Strategy(communication=CommunicationOptions(...))`
  per configuration (`[name, algorithm, compression, implementation]`), built
  one after another.

Every case reduces with `ReplicaContext.all_reduce(SUM, tensors)` inside
`strategy.run` in a `tf.function`: the call Keras 3 makes for gradients
(keras/src/backend/tensorflow/optimizer.py, `_all_reduce_sum_gradients`), so
each strategy's all-reduce runs on the code path `model.fit` takes. The
"stock with bytes_per_pack" case passes
`tf.distribute.experimental.CommunicationOptions(bytes_per_pack=B)` to that
call, which is what a user's strategy-level option amounts to.

For every case and input set: warm-up calls (tracing, group setup), then the
result of the last warm-up is checked against the exact sum of integer-valued
inputs; a wrong result stops the bench before any time is recorded. Each timed
repeat starts after `tfscale.agreement.barrier`, so workers start together;
the launching process takes the slowest worker per repeat.
"""

import time

import numpy as np
import tensorflow as tf

import tfscale
from tfscale.launch.bench import cluster
from tfscale.launch.bench import stats
from tfscale import agreement
from tfscale.collectives import cost_model as cost_model_lib
from tfscale.strategy import KerasMultiWorkerMirroredStrategy


def measure(spec):
    """Measures every case in `spec` on this worker.

    Returns:
        `{"rank", "num_workers", "node_sizes", "rows"}`: one row per case and
        input set (node_sizes: as tfscale grouped the workers; None for stock).
    """
    cases = stock_cases(spec) if spec["side"] == cluster.STOCK else tfscale_cases(spec)
    strategy = cases[0]["strategy"]
    rank, num_workers = strategy.worker_index, strategy.num_workers
    topology = strategy.topology if spec["side"] == "tfscale" else None
    results = {
        "rank": rank,
        "num_workers": num_workers,
        "node_sizes": list(topology.node_sizes) if topology else None,
        "device": strategy.extended.worker_devices[0],
        "rows": [],
    }
    for inputs_name, shapes in spec["input_sets"]:
        inputs = [tf.constant(a) for a in stats.integer_inputs(shapes, rank)]
        expected = stats.expected_sum(shapes, num_workers)
        for case in cases:
            row = measure_case(case, inputs, expected, spec)
            row.update(inputs=inputs_name, rank=rank)
            results["rows"].append(row)
            if rank == 0:
                print(f"measured {inputs_name} {case['label']}: median "
                      f"{np.median(row['repeat_seconds']):.4f} s on worker 0, "
                      f"{row['wrong']} wrong", flush=True)
            if row["wrong"]:
                break
    return results


def measure_case(case, inputs, expected, spec):
    """Warm-up, the exactness check, then the timed repeats of one case."""
    fn, barrier = case["fn"], case["barrier"]
    outputs = None
    for _ in range(spec["warmup"]):
        barrier()
        outputs = fn(inputs)
    wrong = stats.count_wrong([o.numpy() for o in outputs], expected)
    row = {k: v for k, v in case.items() if k not in ("fn", "barrier", "strategy")}
    if spec["side"] == "tfscale":
        # Each bucket: [algorithm, bytes on the wire, chunks].
        row["plan"] = [[b.algorithm, b.wire_bytes, b.num_chunks]
                       for b in case["strategy"].all_reduce_plan(inputs)]
    row.update(wrong=wrong, repeat_seconds=[])
    if wrong:
        return row
    for _ in range(spec["repeats"]):
        barrier()
        start = time.perf_counter()
        outputs = fn(inputs)
        outputs[-1].numpy()  # the call is synchronous; this only makes sure
        row["repeat_seconds"].append(time.perf_counter() - start)
    # The timed results must be right too, not only the warm-up's.
    row["wrong"] = stats.count_wrong([o.numpy() for o in outputs], expected)
    return row


def sum_across_workers(strategy, options=None):
    """A tf.function all-reducing a list of tensors as Keras reduces gradients."""

    @tf.function
    def reduce_fn(tensors):
        def replica_fn(values):
            # Made on the replica's device, as gradients are (MWMS reduces to
            # the device of its inputs and refuses inputs without one).
            values = [tf.identity(v) for v in values]
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, values, options=options)

        out = strategy.run(replica_fn, args=(list(tensors),))
        return [strategy.experimental_local_results(o)[0] for o in out]

    return reduce_fn


def stock_cases(spec):
    """Stock's one pack, and with --gradients its packs of bytes_per_pack."""
    strategy = KerasMultiWorkerMirroredStrategy()
    barrier = agreement.barrier(strategy)
    cases = []
    for bytes_per_pack in [0] + ([spec["bytes_per_pack"]] if spec.get("bytes_per_pack") else []):
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=bytes_per_pack)
        cases.append({
            "fn": sum_across_workers(strategy, options), "barrier": barrier,
            "strategy": strategy, "side": cluster.STOCK, "algorithm": cluster.STOCK,
            "compression": None, "bytes_per_pack": bytes_per_pack,
            "label": cluster.STOCK + (f" bytes_per_pack={stats.human_bytes(bytes_per_pack)}"
                                if bytes_per_pack else " (one pack)"),
        })
    return cases


def tfscale_cases(spec):
    """One `tfscale.Strategy` per configuration in `spec["configs"]`."""
    cost_model = None
    if spec.get("cost_model"):
        cost_model = cost_model_lib.CostModel.from_config(spec["cost_model"])
    cases = []
    for name, algorithm, compression, implementation in spec["configs"]:
        strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
            algorithm=algorithm, compression=compression,
            fusion_threshold_bytes=spec["fusion_threshold_bytes"],
            local_size=spec.get("local_size"), cost_model=cost_model,
            timeout_seconds=spec["collective_timeout"],
            time_all_reduces=False,  # the bench times the call itself
            implementation=implementation))
        cases.append({
            "fn": sum_across_workers(strategy), "barrier": agreement.barrier(strategy),
            "strategy": strategy, "side": "tfscale", "algorithm": algorithm,
            "compression": compression,
            "implementation": strategy.communication_implementation,
            "fusion_threshold_bytes": spec["fusion_threshold_bytes"], "label": name,
        })
    return cases
