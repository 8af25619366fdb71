"""tfscale-bench train: training throughput, scaling efficiency, exposed communication.

Launches, each on synthetic data (`tfscale.data.synthetic`: one random batch
repeated, so no input pipeline cost), Keras `model.fit` with SGD + momentum:

- `single`: ONE worker alone on the machine: T_1, the throughput without any
  all-reduce, per precision.
- one launch of N workers per configuration: `stock` is
  `tf.distribute.MultiWorkerMirroredStrategy` with only tfscale's Keras fix
  (`tfscale.strategy.KerasMultiWorkerMirroredStrategy`; stock Keras 3 `fit` fails on 2+ workers without
  it), so its gradients take TF's own all-reduce (one pack); `lockstep`
  trains each worker alone but ends every step only when all have ended it
  (one 4-byte all-reduce, no gradients): what synchronizing every step costs
  on the same cores with nothing sent, the step a synchronous configuration
  would take on a free link with free arithmetic; the others are
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

`jax` (in --algorithms) is what Keras's maintainers point multi-worker users
to (keras#20585): Keras 3 on JAX with `keras.distribution.DataParallel`, its
gradients all-reduced by JAX's CPU collectives (gloo). It trains the same
model on the same batch with the same optimizer, timed alike
(jax_train_worker.py), from the weights the `single` launch built; its
1-worker images/s is its own, one JAX process alone (`jax_single`). Every
worker trains the same batch, so N workers compute one worker's loss: the
bench checks that JAX's first two losses (the initial weights' and after
one update) are within `LOSS_TOLERANCE` of TensorFlow's one worker, and
fails if they are not.
"""

import importlib.util
import itertools
import os
import shutil
import statistics
import tempfile

from absl import flags
import numpy as np

from tfscale import communication_names
from tfscale.launch.bench import cluster
from tfscale.launch.bench import stats

FLAGS = flags.FLAGS
# Configurations without a tfscale algorithm: one launch each, no threshold.
_BASELINES = (cluster.STOCK, cluster.LOCKSTEP, cluster.JAX)
# How far Keras on JAX's float32 loss may be from TensorFlow's one worker,
# relative, over the first LOSS_CHECK_STEPS steps: the loss of the initial
# weights, then after one update. Only rounding separates them there, of
# different kernels (XLA's, oneDNN's); later updates carry it on and
# amplify it, as they do between TensorFlow's own configurations (the
# table's loss line shows both). A different model, batch, learning rate or
# gradient scale moves the second loss by far more.
LOSS_TOLERANCE = 1e-3
LOSS_CHECK_STEPS = 2


def define_flags():
    """Defines train's flags (and the cluster flags it shares with allreduce)."""
    cluster.define_flags()
    flags.DEFINE_enum("model", "resnet50", ["resnet50", "alexnet_bn", "alexnet_bn_small"],
                      "Model to train (alexnet_bn_small: AlexNet-BN in miniature, "
                      "a run of seconds to try the bench).")
    flags.DEFINE_integer("image_size", 64, "Side of the square synthetic images "
                         "(alexnet_bn needs >= 67).", lower_bound=32)
    flags.DEFINE_integer("fc_units", 4096, "--model=alexnet_bn or alexnet_bn_small: "
                         "fully connected width (4096 as published).", lower_bound=1)
    flags.DEFINE_integer("per_worker_batch", 16, "Images per worker per step.",
                         lower_bound=1)
    flags.DEFINE_integer("steps", 5, "Timed steps per run.", lower_bound=1)
    flags.DEFINE_integer("warmup_steps", 2, "Untimed steps per run (graph "
                         "building).", lower_bound=1)
    flags.DEFINE_list("precisions", ["float32", "mixed_bfloat16"],
                      "Keras global dtype policies to compare.")
    flags.DEFINE_integer("powersgd_rank", 4, "--compression=powersgd: rank of "
                         "the factors.", lower_bound=1)
    flags.DEFINE_integer(
        "powersgd_start_step", 0, "--compression=powersgd: updates all-reduced "
        "uncompressed first (0: every timed step is compressed).", lower_bound=0)
    flags.DEFINE_integer(
        "powersgd_bucket_bytes", None, "--compression=powersgd: gradient bytes "
        "per bucket of matrices compressed together (PowerSGDOptions."
        "bucket_bytes); unset: one bucket.", lower_bound=0)
    flags.DEFINE_list(
        "fusion_thresholds", None, "Compare tfscale at these fusion buffer "
        "sizes in bytes (e.g. 8388608,33554432): each tfscale configuration runs "
        "once per size, named <config>@<size> (2d@8MiB); unset: "
        "--fusion_threshold_bytes alone.")
    flags.DEFINE_string("output", None, "Write the rows as JSON here.")
    flags.DEFINE_bool("plot", False, "With --output: also write a PNG of "
                      "images/s per configuration next to it.")


def summarize(single, launches, num_workers, per_worker_batch, thresholds=None,
              jax_single=None):
    """Rows per (configuration, precision) from the worker outputs.

    Args:
        single: the `single` launch's outputs (one worker).
        launches: `{name: outputs}` of the N-worker launches.
        thresholds: `{name: fusion threshold in bytes}` of the tfscale
            launches (stock has none).
        jax_single: the `jax_single` launch's outputs (one JAX process), the
            1-worker baseline of the `jax` rows.
    """
    thresholds = thresholds or {}

    def alone(outputs):
        return {r["precision"]: statistics.median(r["step_seconds"])
                for r in outputs[0]["runs"] if r["phase"] == "compute"}

    tensorflow_t1 = alone(single)
    rows = []
    for name, outputs in launches.items():
        t1 = alone(jax_single) if name == cluster.JAX else tensorflow_t1
        for precision in t1:
            dist = [_run(o, precision, "distributed") for o in outputs]
            compute = [_run(o, precision, "compute") for o in outputs]
            step, per_step = stats.median_of_max(dist)
            t_compute = max(statistics.median(c) for c in compute)
            waits = [_run(o, precision, "distributed", "exposed_communication_seconds")
                     for o in outputs]
            in_step = None
            if all(waits):
                in_step = statistics.median(min(w) for w in zip(*waits))
            throughput = num_workers * per_worker_batch / step
            rows.append({
                "config": name, "precision": precision, "num_workers": num_workers,
                "per_worker_batch": per_worker_batch,
                "fusion_threshold_bytes": thresholds.get(name),
                "step_seconds": step, "step_seconds_per_step": per_step,
                "compute_seconds": t_compute,
                "step_minus_compute_seconds": step - t_compute,
                "exposed_communication_seconds": in_step,
                "images_per_second": throughput,
                "single_worker_step_seconds": t1[precision],
                "single_worker_images_per_second": per_worker_batch / t1[precision],
                "scaling_efficiency": throughput / (num_workers * per_worker_batch / t1[precision]),
                "efficiency_vs_contended_compute": t_compute / step,
            })
            rows[-1]["gradient_floats"] = _run(outputs[0], precision, "distributed",
                                               "gradient_floats")
            rows[-1]["losses"] = _run(outputs[0], precision, "distributed", "losses")
            rows[-1]["single_worker_losses"] = _run(single[0], precision, "compute",
                                                    "losses")
            buckets = _run(outputs[0], precision, "distributed", "gradient_buckets")
            if buckets:
                rows[-1]["gradient_buckets"] = buckets
            joined = [_run(o, precision, "distributed", "lockstep_workers")
                      for o in outputs]
            if joined[0]:
                rows[-1]["lockstep_workers"] = joined
            powersgd = _run(outputs[0], precision, "distributed", "powersgd")
            if powersgd:
                rows[-1]["powersgd"] = powersgd
            autotune = [_run(o, precision, "distributed", "autotune") for o in outputs]
            if autotune[0]:
                rows[-1]["autotune"] = _least_trials(autotune)
                rows[-1]["autotune_decided_by_step"] = _run(
                    outputs[0], precision, "distributed", "autotune_decided_by_step")
    for key in ("step_minus_compute_seconds", "exposed_communication_seconds"):
        stock = {r["precision"]: r[key] for r in rows if r["config"] == cluster.STOCK}
        for row in rows:
            base, value = stock.get(row["precision"]), row[key]
            row[key.replace("_seconds", "_vs_stock")] = (
                value / base if base and value is not None else None)
    # Steadier than e vs compute, whose baseline (workers unsynchronized on
    # shared cores) moves between launches.
    lockstep = {r["precision"]: r["step_seconds"] for r in rows
                if r["config"] == cluster.LOCKSTEP}
    for row in rows:
        base = lockstep.get(row["precision"])
        row["efficiency_vs_lockstep"] = base / row["step_seconds"] if base else None
    return rows


def _least_trials(reports):
    """The chief's autotune report with each (bucket, candidate)'s trial
    milliseconds, each (threshold, candidate)'s span and each threshold's
    with each bucket its fastest, as every worker chose by: per timed round
    the least over the workers, averaged over the rounds."""
    merged = []
    for plans in zip(*reports, strict=True):  # every worker traced its plans alike
        if len({p["call"] for p in plans}) != 1:
            raise RuntimeError(f"Workers report different all-reduces: {plans}")
        rounds = {key: np.min([p[f"{key}round_milliseconds"] for p in plans], axis=0)
                  for key in ("", "span_", "mix_span_")}
        merged.append({k: v for k, v in plans[0].items()
                       if not k.endswith("round_milliseconds")}
                      | {"trial_milliseconds": rounds[""].mean(axis=2).round(1).tolist(),
                         "span_milliseconds": rounds["span_"].mean(axis=2).round(1).tolist(),
                         "mix_span_milliseconds":
                             rounds["mix_span_"].mean(axis=1).round(1).tolist()})
    return merged


def gradients_line(floats, context):
    """What each step all-reduces and, on a rate-limited link, the least
    time that takes (BENCHMARKS.md, section "The link bound")."""
    line = (f"# gradients: {floats:,} trainable parameters = "
            f"{4 * floats / 1e6:.1f} MB in float32 (MB = 1e6 bytes) per step")
    bound = stats.link_bound_seconds(4 * floats, len(context["node_sizes"]),
                                     context["link_rate"])
    if bound is not None:
        line += (f"; link bound {bound * 1e3:.0f} ms per step with float32 on the wire, "
                 f"{bound * 1e3 / 2:.0f} ms in 16 bits")
    return line


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
              r["compute_seconds"] * 1e3, r["step_minus_compute_seconds"] * 1e3,
              r["step_minus_compute_vs_stock"], ms(r["exposed_communication_seconds"]),
              r["exposed_communication_vs_stock"],
              r["images_per_second"],
              r["single_worker_images_per_second"], r["scaling_efficiency"],
              r["efficiency_vs_contended_compute"]] for r in rows]
    headers = ["config", "precision", "step (ms)", "compute (ms)", "exposed comm (ms)",
               "exposed vs stock", "in-step wait (ms)", "in-step vs stock", "images/s",
               "1 worker images/s", "e", "e vs compute"]
    if any(r["efficiency_vs_lockstep"] is not None for r in rows):
        headers.append("e vs lockstep")
        for line, row in zip(lines, rows):
            line.append(row["efficiency_vs_lockstep"])
    return stats.format_table(headers, lines, ["<", "<"] + [">"] * (len(headers) - 2))


def main():
    """Runs train with its flags; prints the table, writes JSON (and PNG)."""
    configs = cluster.configs(more_compressions=(communication_names.POWERSGD,),
                              more_baselines=(cluster.LOCKSTEP, cluster.JAX))
    with_jax = any(algorithm == cluster.JAX for _, algorithm, _ in configs)
    if with_jax and importlib.util.find_spec("jax") is None:
        raise RuntimeError(
            f"--algorithms={cluster.JAX} trains on Keras's JAX backend, and JAX is not "
            'installed here: pip install "tfscale[jax]" (jax[cpu]), or leave jax out '
            "of --algorithms.")
    thresholds = fusion_thresholds()
    spec = {
        "command": "train", "model": FLAGS.model,
        "image_size": FLAGS.image_size, "fc_units": FLAGS.fc_units,
        "per_worker_batch": FLAGS.per_worker_batch,
        "steps": FLAGS.steps, "warmup_steps": FLAGS.warmup_steps,
        "precisions": FLAGS.precisions, "local_size": FLAGS.local_size,
        "collective_timeout": FLAGS.collective_timeout,
        "powersgd_rank": FLAGS.powersgd_rank,
        "powersgd_start_step": FLAGS.powersgd_start_step,
        "powersgd_bucket_bytes": FLAGS.powersgd_bucket_bytes,
    }
    work_dir = tempfile.mkdtemp(prefix="tfscale-bench-train-")
    try:
        if with_jax:
            # The weights and batch that every launch trains from, for JAX.
            spec["reference_path"] = os.path.join(work_dir, "reference.npz")
        single = cluster.launch_workers(dict(spec, kind="single", name="single"), work_dir,
                                        "single", num_workers=1, emulate=False)
        jax_single = None
        if with_jax:
            jax_single = cluster.launch_workers(
                dict(spec, kind=cluster.JAX, name="jax_single", alone=True), work_dir,
                "jax_single", num_workers=1, emulate=False)
        launches, launch_thresholds = {}, {}
        for name, algorithm, compression, threshold in _launches(configs, thresholds):
            kind = algorithm if algorithm in _BASELINES else "tfscale"
            launches[name] = cluster.launch_workers(
                dict(spec, kind=kind, name=name, algorithm=algorithm,
                     compression=compression, fusion_threshold_bytes=threshold),
                work_dir, name.replace("+", "-").replace("@", "-"))
            if threshold is not None:
                launch_thresholds[name] = threshold
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    rows = summarize(single, launches, FLAGS.num_workers, FLAGS.per_worker_batch,
                     launch_thresholds, jax_single)
    ctx = cluster.context()
    for row in rows:
        if "powersgd" in row:
            row.update(powersgd_rank=FLAGS.powersgd_rank,
                       powersgd_start_step=FLAGS.powersgd_start_step,
                       powersgd_bucket_bytes=FLAGS.powersgd_bucket_bytes)
        row.update(model=FLAGS.model, image_size=FLAGS.image_size,
                   steps=FLAGS.steps, **{k: ctx[k] for k in (
                       "node_sizes", "local_size", "emulate_nodes", "inter_node_rate")})
    # The steps auto's workers spent before its choice, as they report them.
    decided = sorted({row["autotune_decided_by_step"] for row in rows
                      if "autotune_decided_by_step" in row})
    print(f"# tfscale-bench train: {FLAGS.model} {FLAGS.image_size}x"
          f"{FLAGS.image_size}, synthetic data, SGD momentum, "
          f"{FLAGS.per_worker_batch} images per worker per step; "
          f"{stats.describe_cluster(ctx)}; medians of {FLAGS.steps} timed steps "
          f"after {FLAGS.warmup_steps} warm-up step(s)" + "".join(
              f" (auto: after {steps} more for its trials and decision)"
              for steps in decided))
    print(gradients_line(rows[0]["gradient_floats"], ctx))
    print("# compute = the same step trained alone by every worker at once (no "
          "all-reduce, same CPU sharing); exposed comm = step - compute; "
          "e = images/s / (N x 1 worker images/s); 1 worker = one worker alone "
          "on the machine; e vs compute = compute / step")
    if any(algorithm == cluster.LOCKSTEP for _, algorithm, _ in configs):
        print("# lockstep = every worker trains alone and waits for all the others "
              "at the end of each step (a 4-byte all-reduce), sending no gradients: "
              "what synchronizing every step costs on these cores with nothing sent; "
              "e vs lockstep = lockstep's step / step")
    if with_jax:
        print(f"# {cluster.JAX} = Keras 3 on JAX, keras.distribution.DataParallel over "
              "N processes (gloo); its 1 worker images/s is one JAX process alone")
    print("# in-step wait = exposed_communication_seconds per step (stock: its own "
          "all-reduce, timed alike): time from the last gradient ready to the last "
          "all-reduce done, median over steps of the least-waiting worker; "
          "in-step vs stock = in-step wait / stock's")
    print(table(rows), flush=True)
    for row in rows:
        if "powersgd" in row:
            p = row["powersgd"]
            print(f"# {row['config']} {row['precision']}: rank {row['powersgd_rank']}, "
                  f"{p['compressed_tensors']} tensors compressed; "
                  f"{p['gradient_bytes'] / 1e6:.1f} MB of gradients sent as "
                  f"{p['wire_bytes'] / 1e6:.2f} MB per step "
                  f"({p['gradient_bytes'] / p['wire_bytes']:.1f}x less)")
        for plan in row.get("autotune", []):
            print(f"# {row['config']} {row['precision']}: {plan['call']}: "
                  f"{_threshold_text(plan)}{_choices_text(plan['choices'])} "
                  f"(of {', '.join(plan['candidates'])})"
                  + ("; the timed steps ran it traced as a fixed plan"
                     if plan.get("retraced") else ""))
    mismatch = None
    if with_jax:
        line, mismatch = loss_check(rows, FLAGS.warmup_steps + FLAGS.steps)
        print(line)
    if FLAGS.output:
        stats.write_json(rows, FLAGS.output)
        print(f"tfscale-bench: wrote {len(rows)} rows to {FLAGS.output}")
        if FLAGS.plot:
            path = os.path.splitext(FLAGS.output)[0] + ".png"
            _plot(rows, path, f"{FLAGS.model} training\n{stats.describe_cluster(ctx)}")
            print(f"tfscale-bench: wrote {path}")
    if mismatch:
        raise RuntimeError(mismatch)
    return rows


def loss_check(rows, steps, precision="float32"):
    """Every configuration's loss, step for step, against TensorFlow's one
    worker (the same weights, batch and optimizer; every worker trains the
    same batch, so N workers compute one worker's loss).

    Returns:
        (the line to print, None or the error when the JAX run's first
        LOSS_CHECK_STEPS losses are further than LOSS_TOLERANCE from
        TensorFlow's).
    """
    rows = [r for r in rows if r["precision"] == precision]
    if not rows:
        return f"# loss check: no {precision} run", None
    reference = rows[0]["single_worker_losses"][:steps]
    shown = sorted({*range(1, LOSS_CHECK_STEPS + 1), steps})
    parts, mismatch = [], None
    for row in rows:
        row["loss_vs_single_worker"] = [
            loss / ref - 1 for loss, ref in zip(row["losses"][:steps], reference)]
        differences = row["loss_vs_single_worker"]
        parts.append(f"{row['config']} " + " / ".join(
            f"{differences[step - 1]:+.1e}" for step in shown))
        checked = differences[:LOSS_CHECK_STEPS]
        if row["config"] == cluster.JAX and max(map(abs, checked)) > LOSS_TOLERANCE:
            mismatch = (
                f"Keras on JAX's first {LOSS_CHECK_STEPS} losses differ from TensorFlow's "
                f"one worker's by {', '.join(f'{d:+.2e}' for d in checked)}, more than "
                f"{LOSS_TOLERANCE:g} (relative): the two do not train the same thing, so "
                "their speeds are not comparable.")
    line = (f"# loss ({precision}, fit's running mean; the same weights, batch and "
            f"optimizer everywhere) after {' / '.join(map(str, shown))} steps: 1 worker "
            "on TensorFlow " + " / ".join(f"{reference[step - 1]:.4f}" for step in shown)
            + "; relative to it: " + "; ".join(parts)
            + f"; {cluster.JAX} within {LOSS_TOLERANCE:g} over the first "
            f"{LOSS_CHECK_STEPS}: " + ("no" if mismatch else "yes"))
    return line, mismatch


def fusion_thresholds():
    """The fusion thresholds to compare, in bytes: --fusion_thresholds, or
    --fusion_threshold_bytes alone.

    Raises:
        ValueError: naming the flag, for a value that is not a byte count, or
            for both flags given.
    """
    if FLAGS.fusion_thresholds is None:
        return [FLAGS.fusion_threshold_bytes]
    if FLAGS["fusion_threshold_bytes"].present:
        raise ValueError("Give --fusion_thresholds (sizes to compare) or "
                         "--fusion_threshold_bytes (one size), not both.")
    sizes = []
    for value in FLAGS.fusion_thresholds:
        if not value.isdigit():
            raise ValueError("--fusion_thresholds takes byte counts >= 0 (e.g. "
                             f"8388608,33554432). Received: {value!r}")
        sizes.append(int(value))
    if not sizes or len(set(sizes)) != len(sizes):
        raise ValueError("--fusion_thresholds needs distinct sizes. Received: "
                         f"--fusion_thresholds={','.join(FLAGS.fusion_thresholds)}")
    return sizes


def _launches(configs, thresholds):
    """`[(name, algorithm, compression, threshold)]`: stock and lockstep once
    (TF packs its own; lockstep sends no gradients), each tfscale
    configuration at each threshold, named `<config>@<size>`
    when there is more than one."""
    out = []
    for name, algorithm, compression in configs:
        if algorithm in _BASELINES:
            out.append((name, algorithm, compression, None))
            continue
        for threshold in thresholds:
            label = name if len(thresholds) == 1 else (
                f"{name}@{stats.human_bytes(threshold).replace(' ', '')}")
            out.append((label, algorithm, compression, threshold))
    return out


def _threshold_text(plan):
    """'fusion threshold 8 MiB (of 32 MiB, 8 MiB; spans 2d 7586, ring 7718,
    mix 7400 ms; 2d 6722, ring 6896, mix 6950 ms): ' where auto tried
    several thresholds; 'spans 2d 310, ring 290, mix 280 ms: ' where it
    timed one threshold's calls whole to weigh its buckets' mix; else ''."""
    mixes = any(plan["mix_span_milliseconds"])
    if len(plan["fusion_thresholds"]) == 1 and not mixes:
        return ""
    names = plan["candidates"] + ["mix"] * mixes
    spans = "; ".join(", ".join(f"{a} {ms:.0f}" for a, ms in zip(
        names, [*per_candidate, mix])) + " ms" for per_candidate, mix in zip(
            plan["span_milliseconds"], plan["mix_span_milliseconds"]))
    if len(plan["fusion_thresholds"]) == 1:
        return f"spans {spans}: "
    chosen = plan["fusion_threshold_bytes"]
    tried = ", ".join(stats.human_bytes(t) for t in plan["fusion_thresholds"])
    return (f"fusion threshold {'not decided' if chosen is None else stats.human_bytes(chosen)}"
            f" (of {tried}; spans {spans}): ")


def _choices_text(choices):
    """'ring for buckets 0-2, 2d for bucket 3'; 'not decided' for None."""
    if choices is None:
        return "not decided"
    runs = []
    for algorithm, group in itertools.groupby(enumerate(choices), key=lambda c: c[1]):
        buckets = [bucket for bucket, _ in group]
        runs.append(f"{algorithm} for bucket {buckets[0]}" if len(buckets) == 1 else
                    f"{algorithm} for buckets {buckets[0]}-{buckets[-1]}")
    return ", ".join(runs)


def _plot(rows, path, title):
    """Bars of images/s per configuration, one series per precision."""
    from tfscale.launch.bench import plot

    names = list(dict.fromkeys(r["config"] for r in rows))
    series = {}
    for precision in dict.fromkeys(r["precision"] for r in rows):
        by_name = {r["config"]: r for r in rows if r["precision"] == precision}
        series[f"images/s {precision}"] = [by_name[c]["images_per_second"] for c in names]
    plot.bars(names, series, path, title, "images/s (all workers)")
