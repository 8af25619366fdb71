"""tfscale-bench: a smoke run of each subcommand, and what each one's --help lists.

The smoke runs use 2 workers on 127.0.0.1 and tiny sizes: they check that the
commands run end to end and write what they promise (the JSON schema, the
PNG), not the numbers.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tfscale.launch.bench import report
from tfscale.launch.bench import train
import multiworker
from multiworker import REPO_ROOT

pytestmark = pytest.mark.multiworker



def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def bench(tmp_path, subcommand, *args, timeout=240, returncode=0):
    """A tfscale-bench run. A subcommand that starts workers forks them from
    a process that imported tfscale's core (`--preload`): its measurements
    begin after their imports either way."""
    command = [sys.executable, "-m", "tfscale.launch.bench", subcommand, *args]
    if subcommand != "project":  # which starts no worker
        # Its preload process forked from the launcher (multiworker.preloaded).
        command = multiworker.preloaded([*command, "--preload=tfscale.strategy"])
    process = multiworker.run(command, tmp_path, multiworker.worker_env(tmp_path), timeout)
    assert process.returncode == returncode, process.stdout[-6000:]
    return process.stdout


def bench_fails(tmp_path, *args):
    """A tfscale-bench run that must end in exit code 1 without a traceback."""
    process = subprocess.run(
        [sys.executable, "-m", "tfscale.launch.bench", *args], cwd=str(tmp_path), env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert process.returncode == 1, process.stderr[-3000:]
    assert "Traceback" not in process.stderr
    return process


@pytest.fixture(scope="module")
def allreduce_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    output = tmp_path / "allreduce.json"
    stdout = bench(tmp_path, "allreduce", "--num_workers=2", "--local_size=1",
                   "--sizes=4KB,64KB",
                   "--algorithms=stock,ring,hierarchical,halving_doubling",
                   "--warmup=1", "--repeats=2", f"--output={output}", "--plot")
    return tmp_path, output, stdout


def test_allreduce_writes_checked_rows_a_table_and_a_plot(allreduce_run):
    tmp_path, output, stdout = allreduce_run
    rows = json.loads(output.read_text())
    assert [(r["label"], r["bytes"]) for r in rows] == [
        (label, size) for size in (4096, 65536)
        for label in ("stock (one pack)", "ring", "hierarchical", "halving_doubling")]
    for row in rows:
        for field in report.REQUIRED_FIELDS:
            assert field in row, field
        assert row["wrong"] == 0
        assert row["num_workers"] == 2 and row["node_sizes"] == [1, 1]
        assert row["seconds"] > 0 and len(row["repeat_seconds"]) == 2
        assert row["algbw"] == pytest.approx(row["bytes"] / row["seconds"])
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
    assert "algbw (MB/s)" in stdout and "#wrong" in stdout
    assert (tmp_path / "allreduce.png").stat().st_size > 1000


def test_project_fits_the_measurements_and_projects_the_paper_hardware(allreduce_run):
    tmp_path, measurements, _ = allreduce_run
    output = tmp_path / "project.json"
    fitted = tmp_path / "fitted.json"
    stdout = bench(tmp_path, "project", f"--measurements={measurements}",
                   f"--fitted_output={fitted}", f"--output={output}", "--gpus=8,16")
    result = json.loads(output.read_text())
    assert json.loads(fitted.read_text())["cost_model"] == result["fit"]["cost_model"]
    assert {(r["model"], r["gpus"]) for r in result["projection"]} == {
        (m, g) for m in ("resnet50", "alexnet_bn") for g in (8, 16)}
    resnet = [r for r in result["projection"] if r["model"] == "resnet50"]
    assert resnet[0]["params"] == 25_557_032
    assert all(0 < r["e_hybrid"] < 1 and 0 < r["e_halving_doubling"] < 1 for r in resnet)
    # PowerSGD rank 4 sends ResNet-50's 102 MB as ~1.5 MB: far less time.
    assert all(0 < r["t_powersgd"] < r["t_hybrid"] / 10 for r in resnet)
    assert "predicted (ms)" in stdout and "NOT FOUND" in stdout
    assert "h-d (ms)" in stdout and "PowerSGD r4 (ms)" in stdout


JAX_MISSING = (None if importlib.util.find_spec("jax") else
               'needs JAX beside TensorFlow: pip install "tfscale[jax]"')


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """One train run for the tests of its rows: stock, lockstep, Keras on
    JAX (where JAX is installed) and ring with PowerSGD at two thresholds,
    so the 1-worker reference and stock's launch run once for all. AlexNet-BN
    in miniature: these tests check the rows, not a model's speed."""
    tmp_path = tmp_path_factory.mktemp("bench_train")
    output = tmp_path / "train.json"
    algorithms = "stock,lockstep,ring" + (",jax" if JAX_MISSING is None else "")
    stdout = bench(
        tmp_path, "train", "--num_workers=2", "--local_size=1", "--model=alexnet_bn_small",
        "--image_size=32", "--fc_units=16", "--per_worker_batch=2", "--steps=2",
        "--warmup_steps=1", "--precisions=float32", f"--algorithms={algorithms}",
        "--compression=powersgd", "--powersgd_rank=2",
        "--fusion_thresholds=33554432,65536", f"--output={output}", timeout=600)
    return {row["config"]: row for row in json.loads(output.read_text())}, stdout


def test_train_reports_throughput_efficiency_and_exposed_communication_per_threshold(
        train_run):
    rows, stdout = train_run
    stock, lockstep = rows["stock"], rows["lockstep"]
    row, small = rows["ring+powersgd@32MiB"], rows["ring+powersgd@64KiB"]
    assert stock["config"] == "stock" and 0 < stock["exposed_communication_seconds"]
    # Every row says what a step all-reduces: the model's size at this input
    # (AlexNet-BN's depends on it), counted by the workers.
    import numpy as np
    from tfscale import models
    model = models.get("alexnet_bn_small", num_classes=1000, input_shape=(32, 32, 3),
                       fc_units=16)
    floats = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert {r["gradient_floats"] for r in (stock, lockstep, row, small)} == {floats}
    assert f"# gradients: {floats:,} trainable parameters = {4 * floats / 1e6:.1f} MB" in stdout
    assert stock["fusion_threshold_bytes"] is None and "gradient_buckets" not in stock
    # Lockstep ran once, without a threshold, and each timed step's barrier
    # joined both workers.
    assert lockstep["config"] == "lockstep" and lockstep["fusion_threshold_bytes"] is None
    assert lockstep["lockstep_workers"] == [[2.0, 2.0], [2.0, 2.0]], lockstep
    assert lockstep["exposed_communication_seconds"] is None
    assert "gradient_buckets" not in lockstep and "powersgd" not in lockstep
    assert lockstep["efficiency_vs_contended_compute"] == pytest.approx(
        lockstep["compute_seconds"] / lockstep["step_seconds"])
    assert "# lockstep = every worker trains alone and waits for all the others" in stdout
    # Every row's step against lockstep's, in the table too.
    assert lockstep["efficiency_vs_lockstep"] == 1.0
    for other in (stock, row, small):
        assert other["efficiency_vs_lockstep"] == pytest.approx(
            lockstep["step_seconds"] / other["step_seconds"])
    assert re.search(r"e vs compute +e vs lockstep\n", stdout), stdout[-3000:]
    # Each tfscale configuration ran at each threshold, its buffers cut there.
    assert (row["config"], small["config"]) == ("ring+powersgd@32MiB", "ring+powersgd@64KiB")
    assert (row["fusion_threshold_bytes"], small["fusion_threshold_bytes"]) == (
        32 * 1024 * 1024, 65536)
    assert row["gradient_buckets"] == 1 < small["gradient_buckets"], (row, small)
    assert row["precision"] == "float32"
    assert row["powersgd_rank"] == 2 and row["powersgd_start_step"] == 0
    # PowerSGD ran: compressed tensors, fewer bytes, error feedback kept.
    powersgd = row["powersgd"]
    assert powersgd["compressed_tensors"] > 0 and powersgd["error_feedback_norm"] > 0
    assert powersgd["wire_bytes"] < powersgd["gradient_bytes"] / 2
    assert row["step_minus_compute_seconds"] == pytest.approx(
        row["step_seconds"] - row["compute_seconds"])
    # Measured inside the step, for stock and tfscale alike: part of the step.
    assert 0 < row["exposed_communication_seconds"] < row["step_seconds"]
    assert row["exposed_communication_vs_stock"] == pytest.approx(
        row["exposed_communication_seconds"] / stock["exposed_communication_seconds"])
    assert row["images_per_second"] == pytest.approx(4 / row["step_seconds"])
    assert row["scaling_efficiency"] == pytest.approx(
        row["images_per_second"] / (2 * row["single_worker_images_per_second"]))


def test_train_under_auto_reports_each_all_reduces_trials_and_choice(tmp_path):
    # Nodes of 2 and 1: ring and hierarchical differ, 2d needs equal nodes.
    # AlexNet-BN: 15 MB of gradients, several buckets at auto's smaller
    # threshold, so its buckets can mix candidates.
    output = tmp_path / "train.json"
    stdout = bench(
        tmp_path, "train", "--num_workers=3", "--local_size=2", "--model=alexnet_bn",
        "--image_size=67", "--fc_units=16", "--per_worker_batch=2", "--steps=1",
        "--warmup_steps=1", "--precisions=float32", "--algorithms=auto",
        "--compression=none", f"--output={output}", timeout=420)
    (row,) = json.loads(output.read_text())
    assert row["config"] == "auto" and row["exposed_communication_vs_stock"] is None
    # The training step's all-reduces decided; the bench's barrier (a few
    # calls) did not finish its trials.
    decided = [plan for plan in row["autotune"] if plan["choices"] is not None]
    assert decided and len(decided) < len(row["autotune"]), row["autotune"]
    for plan in decided:
        candidates, choices = plan["candidates"], plan["choices"]
        assert sorted(candidates) == ["hierarchical", "ring"], plan
        assert set(choices) <= set(candidates), plan
        # Each bucket kept its fastest candidate by the least time over
        # workers (the times are rounded to 0.1 ms), or, where its buckets
        # could mix candidates, one candidate for all whose span was less
        # than the mix's.
        for times in plan["trial_milliseconds"]:
            assert len(times) == 2 and min(times) > 0, plan
        if not all(times[candidates.index(a)] <= min(times) + 0.1
                   for a, times in zip(choices, plan["trial_milliseconds"])):
            spans = plan["span_milliseconds"][
                plan["fusion_thresholds"].index(plan["fusion_threshold_bytes"])]
            mix = plan["mix_span_milliseconds"][
                plan["fusion_thresholds"].index(plan["fusion_threshold_bytes"])]
            assert len(set(choices)) == 1 and mix > 0, plan
            assert spans[candidates.index(choices[0])] <= mix + 0.1, plan
        assert f"# auto float32: {plan['call']}: " in stdout
    assert any(any(plan["mix_span_milliseconds"]) for plan in decided), row["autotune"]
    assert "(auto: after 23 more for its trials and decision)" in stdout


@pytest.mark.skipif(JAX_MISSING is not None, reason=JAX_MISSING or "")
def test_train_against_keras_on_jax_trains_the_same_losses_and_times_both(train_run):
    rows, stdout = train_run
    stock, jax_row = rows["stock"], rows["jax"]
    assert jax_row["config"] == "jax" and jax_row["exposed_communication_seconds"] is None
    assert jax_row["gradient_floats"] == stock["gradient_floats"]
    # Both started from the same weights and trained the same batch: JAX's
    # first loss and its loss after one update (DataParallel over 2
    # processes) are TensorFlow's one worker's, within the bench's
    # tolerance, and the loss moved.
    reference = stock["single_worker_losses"]
    assert reference[2] < reference[0]
    assert len(jax_row["losses"]) == len(reference) == 3
    for step in range(train.LOSS_CHECK_STEPS):
        assert jax_row["losses"][step] == pytest.approx(reference[step],
                                                        rel=train.LOSS_TOLERANCE)
        assert jax_row["loss_vs_single_worker"][step] == pytest.approx(
            jax_row["losses"][step] / reference[step] - 1)
    assert stock["losses"] == pytest.approx(reference, rel=1e-4)
    assert "; jax within 0.001 over the first 2: yes" in stdout
    # Its 1-worker rate is one JAX process's, and its efficiency is against it.
    assert jax_row["single_worker_images_per_second"] != stock["single_worker_images_per_second"]
    assert jax_row["scaling_efficiency"] == pytest.approx(
        jax_row["images_per_second"] / (2 * jax_row["single_worker_images_per_second"]))
    assert re.search(r"\njax +float32 +\d", stdout), stdout[-3000:]


def test_train_against_jax_without_jax_says_what_to_install(tmp_path):
    # sys.modules["jax"] = None makes `import jax` fail, as where it is absent.
    process = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['jax'] = None; "
         "from tfscale.launch.bench import run; run()", "train", "--algorithms=stock,jax"],
        cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, timeout=120)
    assert process.returncode == 1, process.stderr[-3000:]
    assert process.stderr.strip().splitlines()[-1] == (
        "tfscale-bench train: --algorithms=jax trains on Keras's JAX backend, and JAX is "
        'not installed here: pip install "tfscale[jax]" (jax[cpu]), or leave jax out of '
        "--algorithms.")
    assert "launching" not in process.stdout


def test_each_subcommand_lists_its_own_flags_in_help(tmp_path):
    # absl's --help exits with 1.
    allreduce = bench(tmp_path, "allreduce", "--help", returncode=1)
    project = bench(tmp_path, "project", "--help", returncode=1)
    for flag in ("--sizes", "--repeats", "--algorithms", "--num_workers", "--emulate_nodes"):
        assert f"  {flag}:" in allreduce, flag
    for flag in ("--measurements", "--gpus", "--alpha_scale"):
        assert f"  {flag}:" in project and f"  {flag}:" not in allreduce, flag
    for flag in ("--sizes", "--num_workers", "--model"):
        assert f"  {flag}:" not in project, flag
    assert "--test_random_seed" not in allreduce  # TensorFlow's own flags are not ours


def test_a_bad_flag_value_ends_in_one_line_naming_it(tmp_path):
    process = bench_fails(tmp_path, "allreduce", "--algorithms=stock,ringg")
    assert "tfscale-bench allreduce: --algorithms: 'ringg' is unknown" in process.stderr
    # Lockstep is a training baseline; a single all-reduce has none.
    process = bench_fails(tmp_path, "allreduce", "--algorithms=lockstep")
    assert "--algorithms: 'lockstep' is unknown; choose from stock, " in process.stderr
    # PowerSGD compresses whole gradients in training, not single buffers.
    process = bench_fails(tmp_path, "allreduce", "--compression=powersgd")
    assert ("--compression values must be none or one of bfloat16, float16. "
            "Received: --compression=powersgd") in process.stderr
    process = bench_fails(tmp_path, "train", "--fusion_thresholds=8MiB")
    assert ("tfscale-bench train: --fusion_thresholds takes byte counts >= 0 (e.g. "
            "8388608,33554432). Received: '8MiB'") in process.stderr
    process = bench_fails(tmp_path, "train", "--fusion_thresholds=65536",
                          "--fusion_threshold_bytes=65536")
    assert "Give --fusion_thresholds (sizes to compare) or " in process.stderr


def test_gpucheck_without_gpus_says_so_in_one_line_and_starts_no_worker(tmp_path):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has GPUs: gpucheck would run")
    process = bench_fails(tmp_path, "gpucheck")
    lines = [l for l in process.stderr.splitlines() if l.startswith("tfscale-bench")]
    assert lines == [
        "tfscale-bench gpucheck: TensorFlow sees no GPU on this machine "
        f"(tensorflow {tf.__version__}, built without CUDA), so there is no NCCL "
        "to check: run it on a GPU machine with pip install "
        "'tensorflow[and-cuda]'; --ring_only checks only the ring half here; "
        "--commands --num_workers=N prints what to run on N GPUs after the check."]
    assert "launching" not in process.stdout and "Traceback" not in process.stderr


def test_gpucheck_ring_only_checks_every_algorithm_on_cpu_workers(tmp_path):
    stdout = bench(tmp_path, "gpucheck", "--ring_only", "--num_workers=2",
                   "--size=64KB", "--repeats=1", "--collective_timeout=120")
    for rank in (0, 1):
        assert re.search(rf"^worker {rank}: CUDA_VISIBLE_DEVICES[^;]*; sees no GPU; "
                         rf"runs on /job:worker/replica:0/task:{rank}/device:CPU:0$",
                         stdout, re.M), stdout[-3000:]
    rows = re.findall(r"^(\w+) +ring +(\w+) +65536 +[\d.]+ +[\d.e-]+ +[\d.e-]+ +(\d+)$",
                      stdout, re.M)
    # Two workers are one flat node: hierarchical and 2d run as a ring.
    assert rows == [("ring", "ring", "0"), ("hierarchical", "ring", "0"),
                    ("2d", "ring", "0"), ("halving_doubling", "halving_doubling", "0")]
    assert stdout.rstrip().endswith(
        "tfscale-bench gpucheck: all 4 sums exact on 2 workers (ring; \"ran as\": "
        "the algorithm the plan ran, ring where a topology has no hierarchy); "
        "busbw = algbw * 2(n-1)/n. NCCL was NOT checked (--ring_only).")


def test_gpucheck_ring_only_refuses_one_worker_without_importing_tensorflow(tmp_path):
    # --ring_only reads no GPU count, so its checks come before any import
    # of TensorFlow: the process reports what it imported when it exits.
    script = ("import json, sys\n"
              "from tfscale.launch.bench import run\n"
              "try:\n"
              "    run()\n"
              "except SystemExit as exit:\n"
              "    print(json.dumps([exit.code, sorted(m for m in sys.modules if m in (\n"
              "        'tensorflow', 'tfscale.launch.bench.gpucheck'))]))\n")
    process = subprocess.run(
        [sys.executable, "-c", script, "gpucheck", "--ring_only", "--num_workers=1"],
        cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, timeout=120)
    assert process.stderr.strip().splitlines()[-1] == (
        "tfscale-bench gpucheck: gpucheck needs 2 or more workers (one per GPU); "
        "it would run 1."), process.stderr[-3000:]
    assert json.loads(process.stdout) == [1, ["tfscale.launch.bench.gpucheck"]]


def test_scale_reports_start_up_memory_and_checks_each_algorithm(tmp_path):
    # 3 workers share a global batch of 37 (13, 12, 12); the default
    # strategy and the ring each train as one worker does.
    output = tmp_path / "scale.json"
    stdout = bench(tmp_path, "scale", "--worker_counts=3", "--num_workers=3",
                   "--algorithms=default,ring", f"--output={output}")
    (row,) = json.loads(output.read_text())
    assert row["num_workers"] == 3 and row["emulated_nodes"] is None
    assert 0 < row["startup_seconds_median"] <= row["startup_seconds_max"]
    assert 100 < row["peak_memory_mib_median"] <= row["peak_memory_mib_max"]
    assert row["peak_memory_gib_sum"] == pytest.approx(
        3 * row["peak_memory_mib_median"] / 1024, rel=0.2)
    for algorithm in ("default", "ring"):
        check = row["algorithms"][algorithm]
        assert check["bitwise_identical"]
        assert check["max_abs_diff_vs_one_worker"] < 1e-6
    assert "| 3 | loopback |" in stdout


def test_fixedcost_times_bare_ops_stock_and_each_algorithm_on_one_float(tmp_path):
    output = tmp_path / "fixedcost.json"
    stdout = bench(tmp_path, "fixedcost", "--worker_counts=2",
                   "--algorithms=stock,ring,halving_doubling,hybrid", "--warmup=1",
                   "--repeats=3", f"--output={output}")
    rows = json.loads(output.read_text())["rows"]
    cases = [r["case"] for r in rows]
    assert cases == [
        "stock (one pack)", "function call, no collective",
        "CollectiveReduceV2, same key", "CollectiveReduceV2, new key",
        "CollectiveGatherV2 + sum, same key", "CollectiveReduceV2 x 10 chained, per op",
        "ring", "halving_doubling", "hybrid",
        "ring, timeout_seconds=None (no watchdog, no recorder)"], cases
    assert all(r["num_workers"] == 2 and r["ms"] > 0 for r in rows)
    plans = {r["case"]: r["plan"] for r in rows}
    assert plans["halving_doubling"] == [["halving_doubling", 4, 1]]
    # hybrid does not choose halving-doubling, which measures slowest here.
    assert plans["hybrid"][0][0] in ("ring", "hierarchical")
    assert "2 workers (ms)" in stdout and "floor" in stdout
    process = bench_fails(tmp_path, "fixedcost", "--worker_counts=1")
    assert ("tfscale-bench fixedcost: --worker_counts: each needs >= 2 workers. "
            "Received: 1") in process.stderr
