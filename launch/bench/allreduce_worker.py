"""The worker side of `tfscale-bench allreduce`: one process of the cluster.

The bench's launching process writes a spec (JSON) and starts N of these
through tfscale-launch; each runs `measure(spec)` (through worker.py),
which writes its measurements to `<out_prefix>-<rank>.json`. One process can create only one
MultiWorkerMirroredStrategy, so a launch measures one side:

- `"stock"`: a plain `tf.distribute.MultiWorkerMirroredStrategy()`, no
  options, reducing with `ReplicaContext.all_reduce(SUM, tensors)` inside
  `strategy.run` in a `tf.function`: the call Keras 3 makes for gradients
  (keras/src/backend/tensorflow/optimizer.py, `_all_reduce_sum_gradients`).
  The "stock with bytes_per_pack" case passes
  `tf.distribute.experimental.CommunicationOptions(bytes_per_pack=B)` to that
  call, which is what a user's strategy-level option amounts to.
- `"tfscale"`: one `tfscale.Strategy`; each algorithm is a
  `tfscale.collectives.AllReduce` over the Strategy's own collective groups
  (as tests/workers/collectives_all_reduce.py does), in a `tf.function`, the
  code path `model.fit` runs for gradients.

For every case and input set: warm-up calls (tracing, group setup), then the
result of the last warm-up is checked against the exact sum of integer-valued
inputs; a wrong result stops the bench before any time is recorded. Each timed
repeat starts after a barrier (a one-element all-reduce), so workers start
together; the launching process takes the slowest worker per repeat.
"""

import time

import numpy as np
import tensorflow as tf

from launch.bench import stats


def measure(spec):
    """Measures every case in `spec` on this worker.

    Returns:
        `{"rank", "num_workers", "node_sizes", "rows"}`: one row per case and
        input set (worker.py writes it for the launching process).
    """
    if spec["side"] == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = strategy.cluster_resolver.task_id or 0
        num_workers = strategy.num_replicas_in_sync
        cases, barrier, topology = _stock_cases(strategy, spec), _stock_barrier(strategy), None
    else:
        import tfscale

        strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
            algorithm="ring", local_size=spec.get("local_size"),
            timeout_seconds=spec["collective_timeout"]))
        rank, num_workers = strategy.worker_index, strategy.num_workers
        topology = strategy._tfscale_all_reduce.topology
        world = strategy._tfscale_cross_device_ops._groups[0]
        cases = _tfscale_cases(topology, world, spec)
        barrier = tf.function(lambda: world.all_reduce(tf.constant([1.0])))
    results = {
        "rank": rank,
        "num_workers": num_workers,
        "node_sizes": list(topology.node_sizes) if topology else None,
        "rows": [],
    }
    for inputs_name, shapes in spec["input_sets"]:
        inputs = [tf.constant(a) for a in stats.integer_inputs(shapes, rank)]
        expected = stats.expected_sum(shapes, num_workers)
        for case in cases:
            row = _measure(case, inputs, expected, barrier, spec)
            row.update(inputs=inputs_name, rank=rank)
            results["rows"].append(row)
            if rank == 0:
                print(f"measured {inputs_name} {case['label']}: median "
                      f"{np.median(row['repeat_seconds']):.4f} s on worker 0, "
                      f"{row['wrong']} wrong", flush=True)
            if row["wrong"]:
                break
    return results


def _measure(case, inputs, expected, barrier, spec):
    fn = case["fn"]
    outputs = None
    for _ in range(spec["warmup"]):
        barrier()
        outputs = fn(inputs)
    wrong = stats.count_wrong([o.numpy() for o in outputs], expected)
    row = {k: v for k, v in case.items() if k not in ("fn", "reducer")}
    if "reducer" in case:
        # Each bucket: [algorithm, bytes on the wire, chunks].
        row["plan"] = [[b.algorithm, b.wire_bytes, b.num_chunks]
                       for b in case["reducer"].plan(inputs)]
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


def _stock_barrier(strategy):
    one = tf.constant([1.0])

    @tf.function
    def barrier():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.identity(one)))

    return barrier


def _stock_cases(strategy, spec):
    cases = []
    for bytes_per_pack in [0] + ([spec["bytes_per_pack"]] if spec.get("bytes_per_pack") else []):
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=bytes_per_pack)

        @tf.function
        def reduce_fn(tensors, options=options):
            def replica_fn(values):
                # Made on the replica's device, as gradients are (MWMS reduces
                # to the device of its inputs and refuses inputs without one).
                values = [tf.identity(v) for v in values]
                return tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, values, options=options)

            out = strategy.run(replica_fn, args=(list(tensors),))
            return [strategy.experimental_local_results(o)[0] for o in out]

        cases.append({
            "fn": reduce_fn, "side": "stock", "algorithm": "stock",
            "compression": None, "bytes_per_pack": bytes_per_pack,
            "label": "stock" + (f" bytes_per_pack={stats.human_bytes(bytes_per_pack)}"
                                if bytes_per_pack else " (one pack)"),
        })
    return cases


def _tfscale_cases(topology, world, spec):
    from tfscale import collectives
    from tfscale.collectives import cost_model as cost_model_lib

    model = None
    if spec.get("cost_model"):
        model = cost_model_lib.CostModel.from_config(spec["cost_model"])
    cases = []
    for name, algorithm, compression in spec["configs"]:
        reducer = collectives.AllReduce(
            topology, algorithm, spec["fusion_threshold_bytes"],
            compression=compression, cost_model=model,
            log_plans=topology.rank == 0)
        fn = tf.function(lambda tensors, r=reducer: r(list(tensors), world))
        cases.append({
            "fn": fn, "side": "tfscale", "algorithm": algorithm,
            "compression": compression, "reducer": reducer,
            "fusion_threshold_bytes": spec["fusion_threshold_bytes"],
            "label": name,
        })
    return cases
