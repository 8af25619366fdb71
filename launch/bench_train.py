"""tfscale-bench train: training throughput, scaling efficiency, exposed communication.

Launches, each on synthetic data (`tfscale.data.synthetic`: one random batch
repeated, so no input pipeline cost), Keras `model.fit` with SGD + momentum:

- `single`: ONE worker alone on the machine: T_1, the throughput without any
  all-reduce, per precision.
- one launch of N workers per configuration: `stock` is
  `tf.distribute.MultiWorkerMirroredStrategy` with only tfscale's Keras fix
  (`StockStrategy.reduce`; stock Keras 3 `fit` fails on 2+ workers without
  it), so its gradients take TF's own all-reduce (one pack); the others are
  `tfscale.Strategy` with an algorithm and compression.

In every N-worker launch each worker first trains the same model alone (not
in the strategy's scope: no all-reduce) while the other workers do the same,
so that compute is measured under the same sharing of the CPU cores as the
distributed run; then it trains under the strategy. Per precision (Keras
global policy float32 or mixed_bfloat16):

- T_step(N): median over timed steps of the slowest worker's step time.
- T_compute: the slowest worker's median step time training alone.
- exposed communication = T_step(N) - T_compute: what the all-reduce adds to
  a step (the part not hidden behind computation).
- images/s = N x per-worker batch / T_step(N); scaling efficiency
  e = images/s(N) / (N x images/s(1)) with images/s(1) from `single`.
- measured inside the step: each worker's wait on all-reduces after its
  gradients are ready (`tfscale.Strategy.exposed_communication_seconds`;
  stock's own all-reduce is timed by the same ops). Its median over steps of
  the least-waiting worker (the one the others wait for) is the communication
  not hidden behind backprop, without the CPU contention that
  T_step(N) - T_compute also counts.
"""

import json
import os
import statistics
import time

from launch import bench_stats


def run_worker(spec):
    """One worker of a `train` launch; writes `<out_prefix>-<rank>.json`."""
    import keras

    strategy, rank = None, 0
    if spec["kind"] == "stock":
        strategy = _stock_strategy_class()()
        rank = strategy.cluster_resolver.task_id or 0
        _time_stock_all_reduces(strategy)
    elif spec["kind"] == "tfscale":
        import tfscale

        strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
            algorithm=spec["algorithm"], compression=spec["compression"],
            local_size=spec["local_size"],
            fusion_threshold_bytes=spec["fusion_threshold_bytes"],
            timeout_seconds=spec["collective_timeout"]))
        rank = strategy.worker_index
    barrier = _barrier(strategy) if strategy else (lambda: None)
    runs = []
    for precision in spec["precisions"]:
        keras.mixed_precision.set_global_policy(precision)
        barrier()
        runs.append({"precision": precision, "phase": "compute",
                     **_fit(spec, None)})
        if strategy is not None:
            barrier()
            runs.append({"precision": precision, "phase": "distributed",
                         **_fit(spec, strategy)})
        if rank == 0:
            print(f"{spec['name']} {precision}: " + ", ".join(
                f"{r['phase']} median {statistics.median(r['step_seconds']):.3f} s/step"
                for r in runs if r["precision"] == precision), flush=True)
    keras.mixed_precision.set_global_policy("float32")
    path = f"{spec['out_prefix']}-{rank}.json"
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, "runs": runs}, f)
    os.replace(path + ".tmp", path)


def _stock_strategy_class():
    import tensorflow as tf

    class StockStrategy(tf.distribute.MultiWorkerMirroredStrategy):
        """Stock MWMS plus the one change Keras 3 `fit` needs on 2+ workers:
        `reduce` maps over nests and drops `axis` for rank-0 values (as
        tfscale.Strategy.reduce does; keras-team/keras#20585). Gradients take
        TF's own CollectiveAllReduce."""

        def reduce(self, reduce_op, value, axis=None):
            parent = super().reduce

            def reduce_one(v):
                t = v.values[0] if isinstance(v, tf.distribute.DistributedValues) else v
                rank = tf.convert_to_tensor(t).shape.rank
                return parent(reduce_op, v, axis=None if rank == 0 else axis)

            return tf.nest.map_structure(reduce_one, value)

    return StockStrategy


def _time_stock_all_reduces(strategy):
    """Gives a stock strategy the `exposed_communication_seconds` of tfscale's,
    timed the same way around TF's own all-reduce (which stays as it is)."""
    import tensorflow as tf

    from tfscale import _tf_private

    with tf.device(strategy.extended.worker_devices[0]):
        strategy.exposed_communication_seconds = tf.Variable(0.0, dtype=tf.float64,
                                                             trainable=False)
    _tf_private.time_stock_all_reduces(strategy, strategy.exposed_communication_seconds)


def _barrier(strategy):
    import tensorflow as tf

    @tf.function
    def barrier():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.identity(tf.constant([1.0]))))

    return lambda: barrier()


def _fit(spec, strategy):
    """Timed steps of `model.fit`; alone when `strategy` is None.

    Returns:
        `{"step_seconds": [...]}`, plus `"exposed_comm_seconds": [...]` (per
        step, measured in the step) under a `tfscale.Strategy`.
    """
    import contextlib

    import keras

    import models
    from tfscale import data

    exposed = getattr(strategy, "exposed_communication_seconds", None)

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if exposed is not None:
                self.exposed_before = exposed.numpy()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)
            if exposed is not None:
                waits.append(float(exposed.numpy() - self.exposed_before))

    times, waits = [], []
    size = spec["image_size"]
    options = {"fc_units": spec["fc_units"]} if spec["model"] == "alexnet_bn" else {}
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = models.get(spec["model"], num_classes=1000,
                           input_shape=(size, size, 3), **options)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = spec["per_worker_batch"]
    if strategy is None:
        dataset = data.synthetic(batch, size)
    else:
        global_batch = batch * strategy.num_replicas_in_sync
        dataset = strategy.distribute_datasets_from_function(
            lambda context: data.synthetic(global_batch, size, input_context=context))
    model.fit(dataset, epochs=1, steps_per_epoch=spec["warmup_steps"] + spec["steps"],
              callbacks=[StepTimer()], verbose=0)
    timed = {"step_seconds": times[spec["warmup_steps"]:]}
    if exposed is not None:
        timed["exposed_comm_seconds"] = waits[spec["warmup_steps"]:]
    return timed


def configs(algorithms, compressions):
    """`[(name, kind, algorithm, compression)]` for the N-worker launches."""
    out = []
    if "stock" in algorithms:
        out.append(("stock", "stock", None, None))
    for compression in compressions:
        for algorithm in algorithms:
            if algorithm != "stock":
                name = algorithm + (f"+{compression}" if compression else "")
                out.append((name, "tfscale", algorithm, compression))
    return out


def summarize(single, launches, num_workers, per_worker_batch):
    """Rows per (configuration, precision) from the worker outputs.

    Args:
        single: the `single` launch's outputs (one worker).
        launches: `{name: outputs}` of the N-worker launches.
    """
    t1 = {r["precision"]: statistics.median(r["step_seconds"])
          for r in single[0]["runs"] if r["phase"] == "compute"}
    rows = []
    for name, outputs in launches.items():
        for precision in t1:
            dist = [_run(o, precision, "distributed") for o in outputs]
            compute = [_run(o, precision, "compute") for o in outputs]
            step, per_step = bench_stats.median_of_max(dist)
            t_compute = max(statistics.median(c) for c in compute)
            waits = [_run(o, precision, "distributed", "exposed_comm_seconds")
                     for o in outputs]
            in_step = None
            if all(waits):
                in_step = statistics.median(min(w) for w in zip(*waits))
            throughput = num_workers * per_worker_batch / step
            rows.append({
                "config": name, "precision": precision, "num_workers": num_workers,
                "per_worker_batch": per_worker_batch,
                "step_seconds": step, "step_seconds_per_step": per_step,
                "compute_seconds": t_compute,
                "exposed_comm_seconds": step - t_compute,
                "exposed_comm_in_step_seconds": in_step,
                "images_per_second": throughput,
                "single_worker_step_seconds": t1[precision],
                "single_worker_images_per_second": per_worker_batch / t1[precision],
                "scaling_efficiency": throughput / (num_workers * per_worker_batch / t1[precision]),
                "efficiency_vs_contended_compute": t_compute / step,
            })
    for key in ("exposed_comm_seconds", "exposed_comm_in_step_seconds"):
        stock = {r["precision"]: r[key] for r in rows if r["config"] == "stock"}
        for row in rows:
            base, value = stock.get(row["precision"]), row[key]
            row[key.replace("_seconds", "_vs_stock")] = (
                value / base if base and value is not None else None)
    return rows


def _run(output, precision, phase, key="step_seconds"):
    """A worker's per-step `key` values in one run; [] where it has none
    (stock has no in-step wait)."""
    for run in output["runs"]:
        if run["precision"] == precision and run["phase"] == phase:
            return run.get(key, [])
    raise RuntimeError(f"Worker {output['rank']} has no {phase} run for {precision}.")


def table(rows):
    def ms(seconds):
        return None if seconds is None else seconds * 1e3

    lines = [[r["config"], r["precision"], r["step_seconds"] * 1e3,
              r["compute_seconds"] * 1e3, r["exposed_comm_seconds"] * 1e3,
              r["exposed_comm_vs_stock"], ms(r["exposed_comm_in_step_seconds"]),
              r["exposed_comm_in_step_vs_stock"],
              r["images_per_second"],
              r["single_worker_images_per_second"], r["scaling_efficiency"],
              r["efficiency_vs_contended_compute"]] for r in rows]
    return bench_stats.format_table(
        ["config", "precision", "step (ms)", "compute (ms)", "exposed comm (ms)",
         "exposed vs stock", "in-step wait (ms)", "in-step vs stock", "images/s",
         "1 worker images/s", "e", "e vs compute"],
        lines, ["<", "<"] + [">"] * 10)


def main(flags_values, launch_workers, context):
    """Runs `train` with the bench's flags; prints the table, writes JSON."""
    import shutil
    import tempfile

    n = flags_values.num_workers
    compressions = [None if c == "none" else c for c in flags_values.compression]
    for name in flags_values.algorithms:
        if name not in ("stock", "ring", "hierarchical", "2d", "hybrid"):
            raise ValueError(f"--algorithms: {name!r} is unknown.")
    spec = {
        "command": "train", "model": flags_values.model,
        "image_size": flags_values.image_size, "fc_units": flags_values.fc_units,
        "per_worker_batch": flags_values.per_worker_batch,
        "steps": flags_values.steps, "warmup_steps": flags_values.warmup_steps,
        "precisions": flags_values.precisions, "local_size": flags_values.local_size,
        "fusion_threshold_bytes": flags_values.fusion_threshold_bytes,
        "collective_timeout": flags_values.collective_timeout,
    }
    work_dir = tempfile.mkdtemp(prefix="tfscale-bench-train-")
    try:
        single = launch_workers(dict(spec, kind="single", name="single"), work_dir,
                                "single", num_workers=1, emulate=False)
        launches = {}
        for name, kind, algorithm, compression in configs(flags_values.algorithms, compressions):
            launches[name] = launch_workers(
                dict(spec, kind=kind, name=name, algorithm=algorithm,
                     compression=compression), work_dir, name.replace("+", "-"))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    rows = summarize(single, launches, n, flags_values.per_worker_batch)
    ctx = context()
    for row in rows:
        row.update(model=flags_values.model, image_size=flags_values.image_size,
                   steps=flags_values.steps, **{k: ctx[k] for k in (
                       "node_sizes", "local_size", "emulate_nodes", "inter_node_rate")})
    nodes = ctx["node_sizes"]
    link = (f"inter-node link {ctx['inter_node_rate']}" if ctx.get("inter_node_rate")
            else ("emulated nodes" if ctx.get("emulate_nodes") else "loopback"))
    print(f"# tfscale-bench train: {flags_values.model} {flags_values.image_size}x"
          f"{flags_values.image_size}, synthetic data, SGD momentum, "
          f"{flags_values.per_worker_batch} images per worker per step; {n} workers in "
          f"{len(nodes)} node(s) ({link}); medians of {flags_values.steps} timed steps "
          f"after {flags_values.warmup_steps} warm-up step(s)")
    print("# compute = the same step trained alone by every worker at once (no "
          "all-reduce, same CPU sharing); exposed comm = step - compute; "
          "e = images/s / (N x 1 worker images/s); 1 worker = one worker alone "
          "on the machine; e vs compute = compute / step")
    print("# in-step wait = exposed_communication_seconds per step (stock: its own "
          "all-reduce, timed alike): time from the last gradient ready to the last "
          "all-reduce done, median over steps of the least-waiting worker; "
          "in-step vs stock = in-step wait / stock's")
    print(table(rows), flush=True)
    if flags_values.output:
        directory = os.path.dirname(os.path.abspath(flags_values.output))
        os.makedirs(directory, exist_ok=True)
        with open(flags_values.output, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"tfscale-bench: wrote {len(rows)} rows to {flags_values.output}")
        if flags_values.plot:
            from launch import bench_plot

            path = os.path.splitext(flags_values.output)[0] + ".png"
            precisions = list(dict.fromkeys(r["precision"] for r in rows))
            names = list(dict.fromkeys(r["config"] for r in rows))
            series = {}
            for precision in precisions:
                by_name = {r["config"]: r for r in rows if r["precision"] == precision}
                series[f"images/s {precision}"] = [by_name[c]["images_per_second"] for c in names]
            bench_plot.bars(names, series, path,
                            f"{flags_values.model} training, {n} workers ({link})",
                            "images/s (all workers)")
            print(f"tfscale-bench: wrote {path}")
    return rows
