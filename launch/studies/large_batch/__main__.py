"""`python -m tfscale.launch.studies.large_batch`: runs the study.

`main` trains every variant the flags ask for, prints what each run
measured and the report, and writes the doc and the plot; the package's
docstring (`__init__.py`) says what each setting is.
"""

import sys
import time

from absl import app
from absl import flags

from tfscale.launch import flag_help
from tfscale.launch.studies import large_batch
from tfscale.launch.studies.large_batch import plot
from tfscale.launch.studies.large_batch import report
from tfscale.launch.studies.large_batch import study_flags
from tfscale.launch.studies.large_batch import variants

FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    study_flags.check_flags()
    # TensorFlow is imported here, after the flags are checked.
    from tfscale.launch.studies.large_batch import training

    command = " ".join(["python -m tfscale.launch.studies.large_batch",
                        *sys.argv[1:]])
    say = report.Report()
    say(f"Large-batch study: digits ({variants.NUM_TRAIN} train / 360 test "
        f"images), {FLAGS.model}, {FLAGS.epochs} epochs, seeds "
        f"0-{FLAGS.seeds - 1}, momentum {FLAGS.momentum:g}, weight decay "
        f"{FLAGS.weight_decay:g} (not on biases/BN), warmup "
        f"{FLAGS.warmup_epochs:g} epochs (large batch), poly decay (power 2) "
        "to 0 unless the row says slow start.")
    say("Akiba et al. 2017's RMSprop warm-up, slow start and BatchNorm "
        "without moving averages are reconstructed from public Chainer code "
        "(the paper's text was not available; see their docstrings).")
    jobs = [(v, p, s) for v in variants.from_flags() for p in v.precisions()
            for s in range(FLAGS.seeds)]
    jobs.sort(key=lambda job: FLAGS.precisions.index(job[1])
              if job[1] in FLAGS.precisions else 0)
    runs = {}
    start = time.perf_counter()
    for index, (variant, precision, seed) in enumerate(jobs, start=1):
        run = training.train_once(variant, precision, seed)
        runs.setdefault((variant, precision), []).append(run)
        extra = (f", objective {run.objective:.6f}" if variant.softmax else
                 f", BN recomputed {run.recomputed_accuracy:.2f}%")
        say(f"[{index}/{len(jobs)}] {variant.label}, {precision}, seed "
            f"{seed}: test accuracy {run.accuracy[-1]:.2f}%{extra} "
            f"({run.seconds:.0f} s)")
    say()
    report.alexnet_summary(say, runs)
    say()
    report.softmax_summary(say, runs)
    say()
    say(f"Total time {time.perf_counter() - start:.0f} s.")
    plot.write_plot(runs, FLAGS.plot)
    report.write_doc(FLAGS.doc, command, say.lines, FLAGS.plot)
    print(f"Wrote {FLAGS.doc} and {FLAGS.plot}", flush=True)


def run():
    """Defines the flags, makes `--help` describe the study, runs `main`."""
    study_flags.define_flags()
    # absl's --help prints the docstring and the key flags of the __main__
    # module: the study's description (the package's docstring) and the
    # flags study_flags defined.
    sys.modules["__main__"].__doc__ = large_batch.__doc__
    flag_help.list_in_help(f"{large_batch.__name__}.")
    app.run(main)


if __name__ == "__main__":
    run()
