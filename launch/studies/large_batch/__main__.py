"""`python -m tfscale.launch.studies.large_batch`: runs the study.

`main` runs every run the flags select that is not on disk yet, one JSON
line each, then reports every selected run on disk; the package's docstring
(`__init__.py`) says what each row is.
"""

import datetime
import os
import platform
import re
import subprocess
import sys

from absl import app
from absl import flags

from tfscale.launch import flag_help
from tfscale.launch.studies import large_batch
from tfscale.launch.studies.large_batch import report
from tfscale.launch.studies.large_batch import results
from tfscale.launch.studies.large_batch import rows as study_rows
from tfscale.launch.studies.large_batch import study_flags

FLAGS = flags.FLAGS


def machine():
    """The CPU, its AVX-512 flags, the commit and the date: where the
    numbers were measured."""
    model = "unknown CPU"
    flags_found = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
        found = re.search(r"model name\s*:\s*(.*)", info)
        model = found.group(1).strip() if found else model
        flags_found = set(re.findall(r"\b(avx512\w*|amx\w*)\b", info))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True,
                            cwd=os.path.dirname(__file__)).stdout.strip()
    return (f"Measured on {model} ({os.cpu_count()} cores; "
            f"{' '.join(sorted(flags_found)) or 'no AVX-512'}), "
            f"{platform.python_implementation()} {platform.python_version()}, "
            f"commit {commit or 'unknown'}, {datetime.date.today()}.")


def train_missing(runs, done):
    """Trains the runs not in `done`, the chief writing each as it finishes;
    returns whether this process is the chief."""
    import keras  # TensorFlow: after the flags are checked
    import tfscale
    from tfscale.launch.studies.large_batch import training

    strategy = tfscale.Strategy()  # one per study: every run shares it
    todo = [run for run in runs if run.key not in done]
    print(f"{len(runs)} run{'' if len(runs) == 1 else 's'} selected, "
          f"{len(runs) - len(todo)} already in "
          f"{FLAGS.results}, {len(todo)} to run.", flush=True)
    for index, run in enumerate(todo, start=1):
        record, model = training.train(run, strategy)
        if strategy.is_chief:
            results.append(FLAGS.results, record)
            if FLAGS.weights_dir:
                save_weights(model, os.path.join(FLAGS.weights_dir,
                                                 run.key.replace("|", "_") + ".npz"))
        done[run.key] = record
        print(f"[{index}/{len(todo)}] {run.key}: test accuracy "
              f"{record['final_accuracy']:.2f}% after {record['updates']} "
              f"updates ({record['seconds']:.0f} s)", flush=True)
        keras.backend.clear_session()
    return strategy.is_chief


def save_weights(model, path):
    import numpy as np

    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, **{f"{i}_{w.path}": w.numpy() for i, w in enumerate(model.weights)})


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    study_flags.check_flags()
    rows = study_rows.selected_rows()
    runs = study_rows.runs(rows)
    done = results.load(FLAGS.results)
    if not FLAGS.report_only and not train_missing(runs, done):
        return  # a worker other than the chief: the chief reports
    records = [done[run.key] for run in runs if run.key in done]
    # The command that trains these runs: --report_only only reads them.
    command = " ".join(["python -m tfscale.launch.studies.large_batch",
                        *(a for a in sys.argv[1:] if a != "--report_only")])
    lines = [*report.table(rows, records), "", *report.targets(records)]
    print("\n".join(lines), flush=True)
    if FLAGS.plot and records:
        from tfscale.launch.studies.large_batch import plot

        plot.write_plot(records, FLAGS.plot)
    if FLAGS.doc:
        report.write_page(FLAGS.doc, command, machine(), lines, FLAGS.plot)
        print(f"Wrote {FLAGS.doc}" + (f" and {FLAGS.plot}" if FLAGS.plot else ""),
              flush=True)


def run():
    """Defines the flags, makes `--help` describe the study, runs `main`."""
    study_flags.define_flags()
    # absl's --help prints the docstring and the key flags of the __main__
    # module: the study's description and the flags study_flags defined.
    sys.modules["__main__"].__doc__ = large_batch.__doc__
    flag_help.list_in_help(f"{large_batch.__name__}.")
    app.run(main)


if __name__ == "__main__":
    run()
