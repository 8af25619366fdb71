r"""Training speed per --precision (and with op determinism) on this machine,
synthetic data.

    python -m tfscale.launch.studies.precision_speed --model=resnet50 --image_size=224 \
        --batch_size=8 --steps=3 --warmup_steps=1 --rounds=1
    python -m tfscale.launch.studies.precision_speed --model=alexnet_bn --image_size=67 \
        --fc_units=64 --num_classes=10 --batch_size=64 --steps=4

Each precision trains the same model (built under that dtype policy, SGD
with momentum from `tfscale.recipes`, so mixed_float16 gets its loss
scaling) on one repeated random batch; rounds alternate between the
precisions so that drifting load on a shared machine hits all of them. The
first --warmup_steps of each run (graph building, first-step allocation) are
not timed. Prints the median step time and images/s per precision and the
speed-up over the first precision. Each run is a process of its own (op
determinism, once enabled, stays on for the process), forked from this one,
which has imported TensorFlow but started none of its runtime: each child
starts its own, as tfscale-launch --preload's workers do (launch/preload.py),
without importing TensorFlow again.

    python -m tfscale.launch.studies.precision_speed --model=alexnet_bn --image_size=67 \
        --fc_units=64 --num_classes=10 --batch_size=64 --steps=4 \
        --precisions=float32 --deterministic_too

`--deterministic_too` also times each precision under
`tf.config.experimental.enable_op_determinism()` (tfscale-train
--deterministic): the cost of reproducible kernels, a row "float32,
deterministic" against its precision without.

On a CPU without AVX-512, oneDNN has no bfloat16 kernels and TensorFlow
falls back to Eigen's. TensorFlow also leaves oneDNN off by default on
some CPUs (AMD among them): TF_ENABLE_ONEDNN_OPTS=1 turns it on. What the
commands above print on the benchmark machine: BENCHMARKS.md, section
"Mixed precision and op determinism on one worker".
"""

import json
import os
import statistics
import sys
import traceback

import keras
import tensorflow as tf
from absl import app
from absl import flags

from tfscale import models
from tfscale import callbacks
from tfscale import recipes

FLAGS = flags.FLAGS


def define_flags():
    """Defines the study's flags (`run()` calls it before parsing)."""
    flags.DEFINE_enum("model", "resnet50", ["resnet50", "alexnet_bn"], "Model.")
    flags.DEFINE_integer("image_size", 224, "Side of the square input.")
    flags.DEFINE_integer("batch_size", 8, "Examples per step.")
    flags.DEFINE_integer("steps", 4, "Timed steps per run.", lower_bound=1)
    flags.DEFINE_integer("warmup_steps", 2, "Untimed steps per run.",
                         lower_bound=1)
    flags.DEFINE_integer("rounds", 2, "Runs per precision, alternating.",
                         lower_bound=1)
    flags.DEFINE_list("precisions", ["float32", "mixed_bfloat16"],
                      f"Keras dtype policies to compare, of "
                      f"{', '.join(recipes.PRECISIONS)}.")
    flags.DEFINE_integer("fc_units", 4096,
                         "alexnet_bn's fully connected width.")
    flags.DEFINE_integer("num_classes", 1000, "Output classes.")
    flags.DEFINE_bool("deterministic_too", False,
                      "Also time each precision with op determinism on.")


def time_steps(precision):
    """Seconds per timed step for one run under `precision`."""
    settings = recipes.Settings(precision=precision, learning_rate=0.01,
                                momentum=0.9)
    recipes.set_precision(settings)
    keras.utils.set_random_seed(0)
    options = {"fc_units": FLAGS.fc_units} if FLAGS.model == "alexnet_bn" else {}
    model = models.get(
        FLAGS.model, num_classes=FLAGS.num_classes,
        input_shape=(FLAGS.image_size, FLAGS.image_size, 3), **options)
    steps = FLAGS.warmup_steps + FLAGS.steps
    optimizer, _ = recipes.make_optimizer(settings, FLAGS.batch_size, steps, 1)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    generator = tf.random.Generator.from_seed(0)
    images = generator.normal(
        [FLAGS.batch_size, FLAGS.image_size, FLAGS.image_size, 3])
    labels = generator.uniform([FLAGS.batch_size], maxval=FLAGS.num_classes,
                               dtype=tf.int64)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    timer = callbacks.StepTimer()
    model.fit(data, epochs=1, steps_per_epoch=steps, callbacks=[timer],
              verbose=0)
    keras.backend.clear_session()
    return timer.step_seconds[FLAGS.warmup_steps:]


_DETERMINISTIC = ",deterministic"


def time_one_run(run):
    """Step times of `run` ("PRECISION[,deterministic]") in this process."""
    precision = run.removesuffix(_DETERMINISTIC)
    if run.endswith(_DETERMINISTIC):
        tf.config.experimental.enable_op_determinism()
    return time_steps(precision)


def time_in_a_process(run):
    """Step times of `run`, timed by a child forked from this process."""
    read, write = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return
        os.close(read)
        code = 1
        try:
            with os.fdopen(write, "w") as report:
                report.write(json.dumps(time_one_run(run)))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as report:
        step_seconds = report.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"precision_speed: the run of {run} failed (exit {code}); "
                 "its output is above")
    return json.loads(step_seconds)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    bad = [p for p in FLAGS.precisions if p not in recipes.PRECISIONS]
    if bad or not FLAGS.precisions:
        raise app.UsageError(
            f"--precisions must name some of {', '.join(recipes.PRECISIONS)}."
            f" Received: precisions={FLAGS.precisions!r}")
    runs = [variant for precision in FLAGS.precisions for variant in (
        (precision, precision + _DETERMINISTIC) if FLAGS.deterministic_too
        else (precision,))]
    times = {run: [] for run in runs}
    for round_index in range(FLAGS.rounds):
        for run in runs:
            run_times = time_in_a_process(run)
            times[run] += run_times
            print(f"round {round_index + 1}, {run}: median "
                  f"{statistics.median(run_times):.3f} s/step", flush=True)
    first = FLAGS.precisions[0]
    base = statistics.median(times[first])
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    print(f"{FLAGS.model}, {FLAGS.image_size}x{FLAGS.image_size}, batch "
          f"{FLAGS.batch_size}, {FLAGS.rounds} x {FLAGS.steps} timed steps "
          f"per precision, TF_ENABLE_ONEDNN_OPTS={onednn}:")
    for run in runs:
        step = statistics.median(times[run])
        against = f"{base / step:.2f}x {first}"
        if run.endswith(_DETERMINISTIC):
            plain = statistics.median(times[run.removesuffix(_DETERMINISTIC)])
            against += f", {plain / step:.2f}x without determinism"
        print(f"  {run.replace(',', ', '):29s} median {step:.3f} s/step "
              f"(min {min(times[run]):.3f}, max {max(times[run]):.3f}), "
              f"{FLAGS.batch_size / step:.1f} images/s, {against}", flush=True)


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
