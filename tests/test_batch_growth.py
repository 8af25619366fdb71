"""Growing the batch instead of decaying the learning rate (tfscale.batch_growth).

Single-process: the phase arithmetic (Smith et al.'s Figure 1 schedules),
the fits a resume runs, the learning rate the recipes derive, the refusals,
and tfscale-train's flags. One 2-worker test (tests/workers/
batch_schedule_worker.py): the batch grows at the chosen epoch, the workers
agree, and a run killed mid-phase and restarted ends bitwise equal to one
never interrupted.
"""

import json
import sys

import keras
import numpy as np
import pytest

from tfscale import batch_growth
from tfscale import recipes
from tfscale import schedules
from tests import multiworker


def test_parse_reads_epoch_factor_pairs_and_refuses_bad_text():
    assert batch_growth.parse("30:5,60:5, 80 : 5") == ((30, 5), (60, 5), (80, 5))
    assert batch_growth.parse([(30, 5), (60, 2)]) == ((30, 5), (60, 2))
    assert batch_growth.parse("") == batch_growth.parse(None) == ()
    assert batch_growth.to_string(((30, 5), (60, 2))) == "30:5,60:2"
    with pytest.raises(ValueError, match=r"must be comma-separated epoch:factor "
                       r"pairs.*Received: batch_schedule='30x5', which has '30x5'"):
        batch_growth.parse("30x5")
    with pytest.raises(ValueError, match=r"each later than the one before. "
                       r"Received: epoch 30 after 60"):
        batch_growth.parse("60:5,30:5")
    with pytest.raises(ValueError, match=r"Received: epoch 0 after 0"):
        batch_growth.parse("0:2")
    with pytest.raises(ValueError, match=r"factors must be integers >= 2. "
                       r"Received: factor 1 at epoch 30"):
        batch_growth.parse("30:1")


def _summary(phases):
    return [(p.first_epoch, p.end_epoch, p.global_batch_size, p.steps_per_epoch,
             p.learning_rate_divisor, p.first_step, p.first_example)
            for p in phases]


def test_phases_of_smith_et_al_figure_1_schedules():
    # Section 5.1: batch 128 on CIFAR-10's 50,000 images (390 steps/epoch),
    # 200 epochs, the learning rate divided by 5 at epochs 60, 120 and 160;
    # "increasing batch size" multiplies the batch by 5 there instead, and
    # "hybrid" grows it once (a limit of 640) and then decays.
    args = ("60:5,120:5,160:5", 128, 390, 200)
    growing = batch_growth.phases(*args)
    assert _summary(growing) == [
        (0, 60, 128, 390, 1, 0, 0),
        (60, 120, 640, 78, 1, 23400, 2995200),
        (120, 160, 3200, 15, 1, 28080, 5990400),
        (160, 200, 16000, 3, 1, 28680, 7910400)]
    assert growing[-1].end_step == 28800
    decaying = batch_growth.phases(*args, max_global_batch_size=128)
    assert [(p.global_batch_size, p.learning_rate_divisor) for p in decaying] == [
        (128, 1), (128, 5), (128, 25), (128, 125)]
    assert decaying[-1].end_step == 200 * 390  # 78,000 updates
    hybrid = batch_growth.phases(*args, max_global_batch_size=640)
    assert [(p.global_batch_size, p.steps_per_epoch, p.learning_rate_divisor)
            for p in hybrid] == [(128, 390, 1), (640, 78, 1), (640, 78, 5),
                                 (640, 78, 25)]
    assert hybrid[-1].end_step == 60 * 390 + 140 * 78  # 34,320 updates
    # Without a schedule: one phase, today's arithmetic.
    assert _summary(batch_growth.phases("", 32, 10, 3)) == [
        (0, 3, 32, 10, 1, 0, 0)]


def test_phases_refuse_events_past_training_and_batches_past_an_epoch():
    with pytest.raises(ValueError, match=r"event at epoch 3 is not before the "
                       r"end of training \(3 epochs, numbered 0-2\)"):
        batch_growth.phases("1:2,3:2", 16, 4, 3)
    with pytest.raises(ValueError, match=r"The global batch of phase 2 "
                       r"\(epochs 1-2\), 1600, is larger than an epoch \(64 "
                       r"examples: 4 steps of 16\)"):
        batch_growth.phases("1:100", 16, 4, 3)
    with pytest.raises(ValueError, match=r"`max_global_batch_size` must be at "
                       r"least the first global batch \(16\) or 0"):
        batch_growth.phases("1:2", 16, 4, 3, max_global_batch_size=8)


def test_check_phases_names_the_phase_that_does_not_cut_into_micro_batches():
    phases = batch_growth.phases("1:2", 12, 4, 2)
    batch_growth.check_phases(phases, accumulation_steps=4)
    with pytest.raises(ValueError, match=r"The global batch of phase 1 \(epochs "
                       r"0-0\), 12, does not cut into accumulation_steps \(8\) "
                       r"equal micro-batches. Choose a first global batch and "
                       r"factors whose products divide by 8."):
        batch_growth.check_phases(phases, accumulation_steps=8)
    # Phases of a hand-made list are each checked: the second is named.
    odd = [phases[0], batch_growth.Phase(1, 1, 2, 18, 3, 1, 4, 48)]
    with pytest.raises(ValueError, match=r"phase 2 \(epochs 1-1\), 18, does "
                       r"not cut into accumulation_steps \(4\)"):
        batch_growth.check_phases(odd, accumulation_steps=4)


def _parts(parts):
    return [(p.phase.index, p.initial_epoch, p.epochs, p.steps_per_epoch,
             p.data_step) for p in parts]


def test_fit_parts_resume_mid_phase_and_mid_epoch():
    # 16 x 4 steps in epoch 0; 32 x 2 in epochs 1 and 2 (the cap: the
    # learning rate halves at epoch 2).
    phases = batch_growth.phases("1:2,2:2", 16, 4, 3, max_global_batch_size=32)
    assert _parts(batch_growth.fit_parts(phases)) == [
        (0, 0, 1, 4, 0), (1, 1, 2, 2, 0), (2, 2, 3, 2, 0)]
    # Killed after update 5: one update into phase 2's only epoch.
    assert _parts(batch_growth.fit_parts(phases, 5)) == [
        (1, 1, 2, 1, 1), (2, 2, 3, 2, 0)]
    assert _parts(batch_growth.fit_parts(phases, 6)) == [(2, 2, 3, 2, 0)]
    assert batch_growth.fit_parts(phases, 8) == []
    # Accumulating 2 micro-batches per update: fit steps are micro-batches.
    assert _parts(batch_growth.fit_parts(phases, 10, accumulation_steps=2)) == [
        (1, 1, 2, 2, 2), (2, 2, 3, 4, 0)]
    # One phase: what tfscale-train did before batch schedules.
    single = batch_growth.phases("", 32, 10, 3)
    assert _parts(batch_growth.fit_parts(single, 13)) == [
        (0, 1, 2, 7, 13), (0, 2, 3, 10, 20)]


def test_phase_record_and_a_resume_under_another_schedule_is_refused():
    phases = batch_growth.phases("1:2,2:2", 16, 4, 3, max_global_batch_size=32)
    assert batch_growth.phase_record(phases, 5) == {
        "phase": 1, "global_batch_size": 32, "epoch": 1}
    assert batch_growth.phase_record(phases, 4) == {
        "phase": 1, "global_batch_size": 32, "epoch": 1}
    assert batch_growth.phase_record(phases, 8) == {
        "phase": 2, "global_batch_size": 32, "epoch": 3}
    assert batch_growth.phase_record(phases, 10, accumulation_steps=2) == {
        "phase": 1, "global_batch_size": 32, "epoch": 1}
    saved = {"step": 5, "checkpoint": "step-000000005",
             **batch_growth.phase_record(phases, 5)}
    batch_growth.check_record(phases, saved)
    batch_growth.check_record(phases, None)
    other = batch_growth.phases("2:2", 16, 4, 3)
    with pytest.raises(ValueError, match=r"The checkpoint of step 5 was saved in "
                       r"phase 2 \(global batch 32, epoch 1\), but this batch "
                       r"schedule puts that step in phase 1 \(global batch 16, "
                       r"epoch 1\); resume with the batch schedule it was "
                       r"trained with."):
        batch_growth.check_record(other, saved)


def _rates(schedule, steps):
    if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return [float(schedule)] * len(steps)
    return [round(float(schedule(step)), 7) for step in steps]


def test_learning_rate_stays_while_the_batch_grows_and_decays_past_the_cap():
    """make_schedule counts optimizer updates across phases: the rate is
    divided exactly at the first update of a phase that decays."""
    growing = recipes.Settings(learning_rate=0.1, batch_schedule="1:2,2:2")
    assert recipes.make_schedule(growing, 16, 4, 3) == 0.1
    # Linear scaling applies to the first batch only.
    scaled = recipes.Settings(learning_rate=0.1, batch_schedule="1:2",
                              scale_lr=True, base_batch_size=8)
    assert recipes.make_schedule(scaled, 16, 4, 3) == 0.2
    hybrid = recipes.Settings(learning_rate=0.1, batch_schedule="1:2,2:2",
                              max_global_batch_size=32)
    # Updates 0-3 at 16, 4-5 at 32, 6-7 at 32 with the rate halved.
    assert _rates(recipes.make_schedule(hybrid, 16, 4, 3), range(9)) == [
        0.1] * 6 + [0.05] * 3
    decaying = recipes.Settings(learning_rate=0.1, batch_schedule="1:2,2:2",
                                max_global_batch_size=16)
    assert _rates(recipes.make_schedule(decaying, 16, 4, 3), [3, 4, 7, 8]) == [
        0.1, 0.05, 0.05, 0.025]
    warm = recipes.Settings(learning_rate=0.1, batch_schedule="1:2,2:2",
                            max_global_batch_size=32, warmup_epochs=0.5)
    assert _rates(recipes.make_schedule(warm, 16, 4, 3), [0, 1, 2, 5, 6]) == [
        0.0, 0.05, 0.1, 0.1, 0.05]
    # Accumulation: the optimizer sees micro-batches, the schedule updates.
    _, accumulated = recipes.make_optimizer(
        recipes.Settings(learning_rate=0.1, batch_schedule="1:2,2:2",
                         max_global_batch_size=32, accumulation_steps=2),
        16, 4, 3)
    assert isinstance(accumulated, schedules.PerAccumulatedStep)
    assert _rates(accumulated, [11, 12]) == [0.1, 0.05]


def test_settings_normalize_the_schedule_and_refuse_what_cannot_combine():
    settings = recipes.Settings(batch_schedule=[(30, 5), (60, 5)],
                                max_global_batch_size=8192)
    assert settings == recipes.Settings(batch_schedule=" 30:5, 60:5",
                                        max_global_batch_size=8192)
    assert settings.batch_schedule == "30:5,60:5"
    assert recipes.Settings.from_config(settings.get_config()) == settings
    assert recipes.describe(settings).endswith(
        "lr constant 0.05, global batch x5 from epoch 30, x5 from epoch 60 up "
        "to 8192, then lr / factor, precision float32")
    with pytest.raises(ValueError, match=r"`batch_schedule` replaces the "
                       r"learning-rate decay, so it needs lr_schedule='constant'"
                       r" \(a warmup is allowed\). Received: "
                       r"batch_schedule='30:5', lr_schedule='warmup_poly'"):
        recipes.Settings(batch_schedule="30:5", lr_schedule="warmup_poly")
    with pytest.raises(ValueError, match=r"`max_global_batch_size` limits the "
                       r"growth of `batch_schedule`"):
        recipes.Settings(max_global_batch_size=1024)
    with pytest.raises(ValueError, match=r"`warmup_epochs` must end before the "
                       r"batch schedule's first event \(epoch 1\)"):
        recipes.make_schedule(recipes.Settings(batch_schedule="1:2",
                                               warmup_epochs=2), 16, 4, 3)


def _train(args, cwd, timeout=240):
    return multiworker.run([sys.executable, "-m", "tfscale.launch.train", *args], cwd,
                           multiworker.worker_env(cwd), timeout)


@pytest.mark.multiworker
def test_tfscale_train_grows_the_batch_and_records_the_phase(tmp_path):
    """One worker: the log names each phase, the checkpoint holds the
    updates of the grown batches and the phase it ends in."""
    process = _train(["--model=alexnet_bn_small", "--fc_units=8", "--global_batch_size=16",
                      "--steps_per_epoch=2", "--epochs=3", "--batch_schedule=1:2,2:2",
                      "--max_global_batch_size=32", "--export_dir=",
                      f"--model_dir={tmp_path / 'run'}"], tmp_path)
    assert process.returncode == 0, process.stdout[-4000:]
    assert ("Batch schedule: phase 2 (epochs 1-1): global batch 32 (32 per "
            "worker), 1 steps/epoch, learning rate / 1.") in process.stdout
    assert ("Batch schedule: phase 3 (epochs 2-2): global batch 32 (32 per "
            "worker), 1 steps/epoch, learning rate / 2.") in process.stdout
    with open(tmp_path / "run" / "state.json") as f:
        state = json.load(f)
    assert (state["step"], state["phase"], state["global_batch_size"],
            state["epoch"]) == (4, 2, 32, 3)
    with open(tmp_path / "run" / "settings.json") as f:
        saved = json.load(f)["settings"]
    assert (saved["batch_schedule"], saved["max_global_batch_size"]) == ("1:2,2:2", 32)


@pytest.mark.multiworker
def test_tfscale_train_refuses_a_phase_that_does_not_cut_into_micro_batches(tmp_path):
    process = _train(["--global_batch_size=32", "--batch_schedule=1:2",
                      "--epochs=2", "--accumulation_steps=3", "--export_dir="],
                     tmp_path)
    assert process.returncode != 0
    assert "Traceback" not in process.stdout, process.stdout[-3000:]
    assert ("tfscale-train: The global batch of phase 1 (epochs 0-0), 32, does "
            "not cut into accumulation_steps (3) equal micro-batches"
            ) in process.stdout, process.stdout[-3000:]


@pytest.mark.multiworker
def test_two_workers_grow_the_batch_and_a_run_killed_mid_phase_resumes_bitwise(tmp_path):
    """2 workers, digits, batch 16 for epoch 0, 32 from epoch 1, the rate
    halved from epoch 2 (cap 32). A run whose processes are SIGKILLed right after
    the checkpoint of update 5 (mid-phase 2, mid-epoch 1) is restarted:
    it ends with the weights, bit for bit, of a run never stopped, and
    every worker holds the same weights."""
    killed_dir = tmp_path / "killed"
    killed = multiworker.launch_workers("batch_schedule_worker.py", 2, tmp_path / "first",
        why='a worker SIGKILLs itself mid-run',
        args=[f"--model_dir={killed_dir}", "--kill_at_step=5"], timeout=180)
    assert killed.returncode != 0, killed.output[-3000:]
    with open(killed_dir / "state.json") as f:
        state = json.load(f)
    assert (state["step"], state["phase"], state["global_batch_size"],
            state["epoch"]) == (5, 1, 32, 1)

    run = multiworker.run_workers(
        "batch_schedule_worker.py", 2, tmp_path / "second",
        args=[f"--model_dir={killed_dir}", f"--straight_dir={tmp_path / 'straight'}"],
        timeout=180)
    multiworker.assert_succeeded(run)
    chief = run.results[0]
    straight, resumed = chief["straight"], chief["resumed"]
    # The batch doubles at epoch 1: 8 then 16 per worker, 4 then 2 steps.
    assert straight["fits"] == [
        {"epochs": [0, 1], "steps_per_epoch": 4, "batch_per_worker": 8},
        {"epochs": [1, 2], "steps_per_epoch": 2, "batch_per_worker": 16},
        {"epochs": [2, 3], "steps_per_epoch": 2, "batch_per_worker": 16}]
    assert resumed["start_step"] == 5
    assert resumed["fits"] == [
        {"epochs": [1, 2], "steps_per_epoch": 1, "batch_per_worker": 16},
        {"epochs": [2, 3], "steps_per_epoch": 2, "batch_per_worker": 16}]
    for result in (straight, resumed):
        assert result["updates"] == 8  # 12 at a fixed batch of 16
        assert result["learning_rate"] == pytest.approx(0.05)  # halved at the cap
        assert result["record"] == {"step": 8, "phase": 2,
                                    "global_batch_size": 32, "epoch": 3}
    for a, b in zip(resumed["weights"], straight["weights"], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = run.results[1]
    for name in ("straight", "resumed"):
        for a, b in zip(other[name]["weights"], chief[name]["weights"], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
