"""`python -m tfscale.flight_report LOG ...`: without tfscale-launch
(Kubeflow, SLURM), the summary of who is behind from the workers' saved
logs, worded as tfscale-launch words it (`flight_report.summarize`).

In-process through `main`, with no worker process; one test runs the
command itself, marked as conftest.py asks of a test that starts Python."""

import json
import subprocess
import sys

import pytest

from tfscale import flight_report


def bucket(step, index, sequence, completed):
    """A record as FlightRecorder.records() gives it: gradient bucket
    `index` of 4 of `step`."""
    return {"op": "all_reduce", "group": 1, "group_size": 3, "algorithm": "ring",
            "dtype": "float32", "elements": 4754, "purpose": "gradients",
            "bucket": index, "buckets": 4, "variables": "dense/kernel .. dense/bias",
            "sequence": sequence, "step": step, "issued": 1718000000.0 + sequence,
            "completed": completed}


def position(worker, pending, completed):
    return {"worker": worker, "pending": pending, "completed": completed}


def report(position, prefix=""):
    """A worker's lines as FlightRecorder.report prints them."""
    lines = [f"tfscale flight recorder, worker {position['worker']} "
             "(collectives left pending at exit):"]
    if position["pending"]:
        lines.append(f"  waits 300.0 s in {flight_report.describe(position['pending'])}")
    if position["completed"]:
        lines.append(f"  last completed: {flight_report.describe(position['completed'])}")
    lines.append(flight_report.LINE_PREFIX + json.dumps(position))
    return [prefix + line for line in lines]


TRAINING = ["Epoch 1/2", "100/100 - 3s - loss: 0.6931", "Epoch 2/2"]
# Workers 0 and 1 wait in step 7's bucket 3; worker 2 was killed, its log
# ends with training output.
WAITING = {w: position(w, bucket(7, 3, 30, False), bucket(7, 2, 29, True))
           for w in (0, 1)}


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run(capsys, *argv):
    code = flight_report.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def logs(tmp_path):
    """worker-I.log of each of the 3 workers, as `kubectl logs` saves them."""
    return [write(tmp_path / f"worker-{w}.log",
                  TRAINING + (report(WAITING[w]) if w in WAITING else []))
            for w in (2, 0, 1)]  # any order


def test_it_names_the_worker_behind_from_one_log_per_worker(capsys, logs):
    code, out, err = run(capsys, *logs)
    assert code == 0, err
    expected = flight_report.summarize(WAITING, 3)
    assert out.splitlines() == [f"flight recorder: {expected}.",
                                f"{logs[0]}: no tfscale-flight line"]
    assert ("workers 0, 1 wait in step 7 (gradient bucket 3 of 4) (ring, float32 x "
            "4754); worker 2 sent no report") in out
    # The job's size, when a worker left no log at all.
    code, out, _ = run(capsys, "--num_workers", "4", *logs)
    assert code == 0 and out.startswith(
        f"flight recorder: {flight_report.summarize(WAITING, 4)}."), out
    assert "worker 3 sent no report" in out


def test_one_file_of_interleaved_workers_and_the_last_report_of_each(tmp_path, capsys):
    # SLURM's single output (srun --label): the lines of the 3 workers
    # mixed; worker 2 reported twice (at the collective timeout, then at
    # exit), the last one counts.
    early = position(2, bucket(6, 1, 20, False), bucket(6, 0, 19, True))
    behind = position(2, None, bucket(7, 0, 27, True))
    lines = []
    for worker, reported in ((0, WAITING[0]), (2, early), (1, WAITING[1]), (2, behind)):
        lines += TRAINING[:1] + report(reported, prefix=f"{worker}: ")
    path = write(tmp_path / "job.out", lines)
    code, out, err = run(capsys, path)
    assert code == 0, err
    expected = flight_report.summarize({**WAITING, 2: behind}, 3)
    assert out == f"flight recorder: {expected}.\n"
    assert ("worker 2 is at step 7 (gradient bucket 0 of 4) (last completed, "
            "nothing pending)") in out
    assert "step 6" not in out


def test_logs_without_a_report_exit_1(tmp_path, capsys):
    paths = [write(tmp_path / f"worker-{w}.log", TRAINING) for w in (0, 1)]
    code, out, err = run(capsys, *paths)
    assert (code, out) == (1, "")
    assert err == ("python -m tfscale.flight_report: none of the 2 log(s) holds a "
                   "tfscale-flight line (a worker prints one when it fails with "
                   "collectives pending)\n")


def test_a_missing_log_exits_2_naming_it(tmp_path, capsys, logs):
    missing = str(tmp_path / "worker-3.log")
    code, out, err = run(capsys, *logs, missing)
    assert (code, out) == (2, "")
    assert err == (f"python -m tfscale.flight_report: {missing}: "
                   "No such file or directory\n")


@pytest.mark.multiworker
def test_python_dash_m_prints_it_and_exits_with_its_code(tmp_path, capsys, logs):
    def command(*argv):
        return subprocess.run([sys.executable, "-m", "tfscale.flight_report", *argv],
                              capture_output=True, text=True, timeout=120)

    done = command(*logs)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert run(capsys, *logs) == (0, done.stdout, "")
    done = command(*logs, str(tmp_path / "worker-3.log"))
    assert done.returncode == 2 and "worker-3.log: No such file" in done.stderr
    assert "Traceback" not in done.stderr
    done = command(write(tmp_path / "empty.log", TRAINING))
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
