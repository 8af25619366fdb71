"""A non-finite loss in float32 stops training clearly and keeps the last good
checkpoint."""

import pytest
import json

import numpy as np
import tensorflow as tf

from multiworker import preloaded
from multiworker import run
from multiworker import worker_env

pytestmark = pytest.mark.multiworker



def test_nan_loss_stops_every_worker_and_keeps_the_last_good_checkpoint(tmp_path):
    model_dir = tmp_path / "model"
    process = run(preloaded(
        ["tfscale-launch", "--num_workers=2", "--timeout=300", "--preload=tfscale.strategy",
         "--", "tfscale-train", "--fc_units=32", "--global_batch_size=32", "--epochs=3",
         "--steps_per_epoch=10", "--learning_rate=1e12", "--checkpoint_steps=1",
         f"--model_dir={model_dir}", "--export_dir="]),
        tmp_path, worker_env(tmp_path), timeout=360)
    output = process.stdout
    assert process.returncode != 0, output[-3000:]
    assert "(averaged over all workers) is nan at step" in output, output[-3000:]
    state = json.loads((model_dir / "state.json").read_text())
    assert f"The last good checkpoint (step {state['step']})" in output
    bad_step = int(output.split("is nan at step ")[1].split(";")[0])
    assert state["step"] < bad_step
    reader = tf.train.load_checkpoint(str(model_dir / state["checkpoint"] / "ckpt"))
    for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            assert np.all(np.isfinite(value)), name
