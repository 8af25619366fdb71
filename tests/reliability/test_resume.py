"""Resume: a relaunch with other training settings is refused. (A run killed
mid-training and relaunched is tests/reliability/test_automatic_restart.py.)"""

import pytest
import json

import multiworker
from multiworker import saved_step
from multiworker import worker_env

pytestmark = pytest.mark.multiworker



def test_resuming_with_a_changed_learning_rate_is_refused_naming_only_that_change(tmp_path):
    model_dir = tmp_path / "model"
    base = ["tfscale-train", "--model=alexnet_bn_small", "--fc_units=8", "--global_batch_size=32",
            "--epochs=1", "--steps_per_epoch=2", f"--model_dir={model_dir}",
            "--export_dir="]
    env = worker_env(tmp_path)
    first = multiworker.run(base, tmp_path, env, timeout=300)
    assert first.returncode == 0, first.stdout[-4000:]
    # As written before --bn_statistics_batches existed: left at its default,
    # the flag must not count as a change.
    settings = json.loads((model_dir / "settings.json").read_text())
    del settings["training"]["bn_statistics_batches"]
    (model_dir / "settings.json").write_text(json.dumps(settings))
    saved = (model_dir / "settings.json").read_text()
    assert saved_step(model_dir) == 2

    second = multiworker.run(base + ["--learning_rate=0.1"], tmp_path, env, timeout=300)
    assert second.returncode != 0
    assert "Traceback" not in second.stdout, second.stdout[-4000:]
    assert (f"tfscale-train: The checkpoints in {model_dir} were written with "
            "other settings; resume with the settings they were written with, "
            "or train in another directory:\n"
            "  learning_rate: 0.05 saved, 0.1 now\n") in second.stdout + "\n"
    assert "bn_statistics_batches" not in second.stdout
    assert (model_dir / "settings.json").read_text() == saved
    assert saved_step(model_dir) == 2
