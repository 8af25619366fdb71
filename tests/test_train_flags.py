"""Tests for launch/train_flags.py: tfscale-train's flags -> the library."""

import json
import os
import subprocess
import sys

import keras
import pytest
from absl import flags
from absl.testing import flagsaver

import tfscale
from tfscale.launch import train_flags
from tfscale import recipes
from tfscale import schedules

FLAGS = flags.FLAGS
train_flags.define_flags()
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean_state():
    with flagsaver.flagsaver():
        yield
    FLAGS.unparse_flags()
    keras.mixed_precision.set_global_policy("float32")


def parse(*args):
    FLAGS.unparse_flags()
    FLAGS(["tfscale-train", *args])
    return train_flags.settings_from_flags()


def build_optimizer(global_batch_size, steps_per_epoch, epochs):
    return recipes.make_optimizer(train_flags.settings_from_flags(),
                                  global_batch_size, steps_per_epoch, epochs)


def describe(global_batch_size):
    return recipes.describe(train_flags.settings_from_flags(),
                            global_batch_size)


def test_defaults_are_todays_sgd():
    assert parse() == recipes.Settings()
    optimizer, learning_rate = build_optimizer(64, 22, 8)
    assert type(optimizer) is keras.optimizers.SGD
    assert learning_rate == 0.05
    assert optimizer.get_config()["momentum"] == 0.9
    assert describe(64) == (
        "optimizer sgd (momentum 0.9), lr constant 0.05, precision float32")


def test_flags_reach_the_optimizer_and_schedule():
    parse("--optimizer=lars", "--weight_decay=1e-4", "--eeta=0.002",
          "--lars_epsilon=1e-5", "--momentum=0.8", "--learning_rate=0.1",
          "--scale_lr", "--base_batch_size=256", "--lr_schedule=warmup_poly",
          "--warmup_epochs=1", "--poly_power=1", "--end_learning_rate=0.01")
    optimizer, schedule = build_optimizer(1024, 10, 5)
    assert type(optimizer) is tfscale.optimizers.LARS
    config = optimizer.get_config()
    assert (config["weight_decay_rate"], config["eeta"], config["epsilon"],
            config["momentum"]) == (1e-4, 0.002, 1e-5, 0.8)
    assert isinstance(schedule, schedules.WarmupPolynomialDecay)
    assert schedule.get_config() == {
        "initial_learning_rate": 0.4, "decay_steps": 50, "warmup_steps": 10,
        "end_learning_rate": 0.01, "power": 1.0,
        "warmup_initial_learning_rate": 0.0}
    assert describe(1024) == (
        "optimizer lars (momentum 0.8, weight decay 0.0001 except bias/BN, "
        "eeta 0.002, epsilon 1e-05), lr warmup_poly 0.4 (= 0.1 x 1024/256), "
        "warmup 1 epochs, power 1 to 0.01, precision float32")


def test_mixed_float16_wraps_in_tfscale_loss_scale_and_compile_keeps_it():
    parse("--optimizer=lars", "--precision=mixed_float16")
    recipes.set_precision(train_flags.settings_from_flags())
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    optimizer, _ = build_optimizer(64, 10, 2)
    assert type(optimizer) is tfscale.optimizers.LossScaleOptimizer
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer


def test_mixed_bfloat16_sets_the_policy_without_loss_scaling():
    parse("--precision=mixed_bfloat16")
    recipes.set_precision(train_flags.settings_from_flags())
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    optimizer, _ = build_optimizer(64, 10, 2)
    assert type(optimizer) is keras.optimizers.SGD


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_recipes_load_and_build(name):
    recipe = recipes.RECIPES[name]
    settings = parse(f"--recipe={name}", "--scale_lr")
    for key, value in recipe.items():
        assert getattr(settings, key) == value, key
    # At the published batch the scaled learning rate is the published one.
    batch = recipe["base_batch_size"]
    assert settings.peak_learning_rate(batch) == recipe["learning_rate"]
    optimizer, schedule = build_optimizer(batch, 40, 90)
    assert type(optimizer) is tfscale.optimizers.LARS
    warmup = schedules.epochs_to_steps(recipe["warmup_epochs"], 40)
    assert float(schedule(warmup)) == pytest.approx(recipe["learning_rate"])
    assert describe(batch).endswith(f"recipe {name}")


def test_explicit_flags_override_the_recipe():
    settings = parse("--recipe=resnet50_lars_32k", "--learning_rate=20",
                     "--warmup_epochs=2", "--precision=mixed_bfloat16",
                     "--scale_lr")
    assert settings.learning_rate == 20.0
    assert settings.warmup_epochs == 2.0
    assert settings.weight_decay == 1e-4  # from the recipe
    assert settings.peak_learning_rate(8192) == pytest.approx(5.0)
    assert describe(8192) == (
        "optimizer lars (momentum 0.9, weight decay 0.0001 except bias/BN, "
        "eeta 0.001, epsilon 1e-05), lr warmup_poly 5 (= 20 x 8192/32768), "
        "warmup 2 epochs, power 2 to 0.0001, precision mixed_bfloat16, "
        "recipe resnet50_lars_32k")


def test_bad_flag_values_are_refused():
    with pytest.raises(flags.IllegalFlagValueError, match="precision"):
        parse("--precision=float16")
    with pytest.raises(flags.IllegalFlagValueError, match="weight_decay"):
        parse("--weight_decay=-1")
    with pytest.raises(flags.IllegalFlagValueError, match="recipe"):
        parse("--recipe=resnet50_lars_64k")


def test_flags_are_defined_once_and_not_on_import():
    source = open(train_flags.__file__, encoding="utf-8").read()
    module_level = [line for line in source.splitlines()
                    if line.startswith("flags.DEFINE")]
    assert module_level == []
    train_flags.define_flags()  # again: no DuplicateFlagError


def test_training_and_shared_flags():
    parse("--global_batch_size=128", "--model_dir=/somewhere", "--seed=3")
    training = train_flags.training_from_flags()
    assert training["global_batch_size"] == 128 and training["seed"] == 3
    assert "model_dir" not in training and "learning_rate" not in training
    shared = train_flags.shared_flags()
    assert shared["learning_rate"] == 0.05 and shared["algorithm"] is None
    assert not train_flags.LOCAL_FLAGS & shared.keys()


def test_implementation_is_shared_by_all_workers_but_not_a_training_flag():
    # Every worker must run the same implementation (its collectives meet
    # the others'); a run may resume under another one, as under another
    # --algorithm: how gradients are summed, not what.
    parse("--implementation=ring")
    assert train_flags.shared_flags()["implementation"] == "ring"
    assert "implementation" not in train_flags.training_from_flags()
    assert parse() is not None and FLAGS.implementation == "auto"
    with pytest.raises(flags.IllegalFlagValueError, match="implementation"):
        parse("--implementation=NCCL")


@pytest.mark.parametrize("command", [["tfscale-train"],
                                     [sys.executable, "-m", "tfscale.launch.train"]])
@pytest.mark.multiworker
def test_help_lists_every_flag(command):
    """`--help` (not only --helpfull) lists the flags of every group."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    process = subprocess.run([*command, "--help"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=120,
                             cwd=REPO_ROOT, env=env)
    # absl's --help exits with status 1 after printing.
    assert "Try --helpfull" in process.stdout, process.stdout[-3000:]
    for flag in FLAGS.get_flags_for_module(train_flags.__name__):
        assert f"  --{flag.name}:" in process.stdout or (
            f"  --[no]{flag.name}:" in process.stdout), flag.name
    for name in ("optimizer", "recipe", "algorithm", "model"):
        assert f"  --{name}:" in process.stdout


def test_accumulation_steps_reach_the_optimizer_and_its_schedule():
    settings = parse("--accumulation_steps=4", "--lr_schedule=warmup_poly",
                     "--warmup_epochs=1", "--optimizer=lars")
    assert settings.accumulation_steps == 4
    assert train_flags.training_from_flags().keys().isdisjoint({"accumulation_steps"})
    optimizer, learning_rate = build_optimizer(64, 5, 3)
    assert optimizer.gradient_accumulation_steps == 4
    assert type(learning_rate) is schedules.PerAccumulatedStep
    # Updates, not micro-batches, drive the schedule: 5 updates per epoch.
    inner = learning_rate.schedule
    assert inner.warmup_steps == 5 and inner.decay_steps == 15
    assert float(optimizer.learning_rate) == 0.0
    assert float(learning_rate(4 * 5 + 3)) == float(inner(5))
    assert ", 4 micro-batches per step," in describe(64)
    parse("--accumulation_steps=1")
    optimizer, _ = build_optimizer(64, 5, 3)
    assert optimizer.gradient_accumulation_steps is None


def test_akiba_techniques_have_flags():
    settings = parse("--optimizer=rmsprop_warmup", "--lr_schedule=slow_start",
                     "--rmsprop_learning_rate=0.002",
                     "--rmsprop_warmup_center_epochs=3",
                     "--rmsprop_warmup_period_epochs=2",
                     "--bn_statistics_batches=20")
    assert (settings.rmsprop_learning_rate, settings.rmsprop_warmup_center_epochs,
            settings.rmsprop_warmup_period_epochs) == (0.002, 3.0, 2.0)
    optimizer, schedule = build_optimizer(64, 10, 9)
    assert type(optimizer) is tfscale.optimizers.RMSpropWarmup
    assert (optimizer.beta_center, optimizer.beta_period) == (30.0, 20.0)
    assert isinstance(schedule, schedules.SlowStart)
    # Recomputing BatchNorm statistics changes the model a resume continues.
    assert "bn_statistics_batches" in train_flags.TRAINING_FLAGS
    assert train_flags.training_from_flags()["bn_statistics_batches"] == 20
    with pytest.raises(flags.IllegalFlagValueError, match="bn_statistics_batches"):
        parse("--bn_statistics_batches=-1")


def test_batch_schedule_flags_reach_the_settings_and_its_refusals():
    settings = parse("--batch_schedule=30:5, 60:5", "--max_global_batch_size=8192")
    assert (settings.batch_schedule, settings.max_global_batch_size) == (
        "30:5,60:5", 8192)
    assert train_flags.training_from_flags().keys().isdisjoint(
        {"batch_schedule", "max_global_batch_size"})  # Settings fields
    with pytest.raises(ValueError, match="needs lr_schedule='constant'"):
        parse("--batch_schedule=30:5", "--lr_schedule=one_cycle")
    with pytest.raises(ValueError, match="must be comma-separated epoch:factor"):
        parse("--batch_schedule=30")
    with pytest.raises(flags.IllegalFlagValueError, match="max_global_batch_size"):
        parse("--max_global_batch_size=-1")


def test_cost_model_flag_is_checked_and_shared_by_its_contents(tmp_path):
    from absl import app
    from tfscale.collectives import cost_model as cost_model_lib
    from tfscale.launch import training

    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    parse(f"--cost_model={bad}")
    with pytest.raises(app.UsageError, match=f"{bad}.*holds no cost model"):
        training.validate_flags(train_flags.Config.from_flags())
    good = tmp_path / "fit.json"
    good.write_text(json.dumps({"cost_model": cost_model_lib.DEFAULT.get_config()}))
    parse(f"--cost_model={good}")
    config = train_flags.Config.from_flags()
    assert training.cost_model_from_flags(config) == cost_model_lib.DEFAULT
    # Workers compare what the file holds, not only its path.
    assert training.shared_settings(config)["cost_model"] == (
        cost_model_lib.DEFAULT.get_config())


def test_the_default_algorithm_stores_autos_choice_in_the_model_dir(tmp_path):
    """Unset --algorithm is auto over TensorFlow's ring: the chief's choice
    goes to --model_dir for a restart; a fixed algorithm, or hybrid's
    threshold, keeps no choice."""
    from tfscale.launch import training

    model_dir = str(tmp_path / "model")
    for args, expected in (((), model_dir), (("--algorithm=auto",), model_dir),
                           (("--algorithm=ring",), None),
                           (("--hybrid_threshold_bytes=4096",), None)):
        parse(f"--model_dir={model_dir}", *args)
        options = training.communication_options(train_flags.Config.from_flags())
        assert options.autotune_dir == expected, args


def test_a_heartbeat_without_reply_names_the_coordination_leader_and_the_flag(monkeypatch):
    # The error a worker raises when its heartbeat to the coordination
    # service timed out (seen behind a saturated link; tests/test_heartbeats.py).
    import tensorflow as tf
    from tfscale.launch import training

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222"]},
        "task": {"type": "worker", "index": 2}}))
    FLAGS.unparse_flags()
    FLAGS(["tfscale-train", "--heartbeat_timeout=20"])
    error = tf.errors.DeadlineExceededError(None, None, (
        "{{function_node __wrapped__CollectiveBcastRecv_device_/job:worker/replica:0/"
        "task:2/device:CPU:0}} Collective ops is aborted by: Deadline Exceeded\n\n"
        "RPC: /tensorflow.CoordinationService/Heartbeat"))
    said = training.describe_failure(train_flags.Config.from_flags(), error)
    assert said.startswith(
        "Lost contact with worker 0 (DeadlineExceededError: this worker's "
        "heartbeat got no reply within 10 s)."), said
    assert "--heartbeat_timeout=20 s" in said
    assert "on a busy link: raise --heartbeat_timeout." in said
    # Another collective error says nothing of heartbeats.
    other = training.describe_failure(train_flags.Config.from_flags(), tf.errors.UnavailableError(
        None, None, "Collective ops is aborted by: Connection refused from "
                    "/job:worker/replica:0/task:1"))
    assert other.startswith("Lost contact with worker 1 (UnavailableError: "), other
    assert "busy link" not in other


def test_an_error_of_the_workers_own_input_pipeline_is_not_called_lost_contact(monkeypatch):
    # tf.data's error when a Python function of this worker's pipeline raised:
    # it names this worker's own task only. Left unexplained, it is raised
    # with its traceback instead of blaming a peer.
    import tensorflow as tf
    from tfscale.launch import training

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
        "task": {"type": "worker", "index": 1}}))
    FLAGS.unparse_flags()
    FLAGS(["tfscale-train"])
    config = train_flags.Config.from_flags()
    for message in ("[[RemoteCall]] [Op:IteratorGetNext] name:",
                    "{{function_node __wrapped__IteratorGetNext_device_/job:worker/"
                    "replica:0/task:1/device:CPU:0}} OSError: [Errno 9] Bad file "
                    "descriptor [Op:IteratorGetNext]"):
        assert training.describe_failure(
            config, tf.errors.UnknownError(None, None, message)) is None, message
    # The same kind of error naming a peer's task is lost contact.
    said = training.describe_failure(config, tf.errors.UnknownError(None, None, (
        "Error received from /job:worker/replica:0/task:0: Socket closed")))
    assert said.startswith("Lost contact with worker 0 (UnknownError: "), said


def test_heartbeat_timeout_is_checked_and_the_same_on_every_worker():
    # The service (on the leader) takes a worker for lost after its own
    # timeout; each worker beats every half of its own.
    with pytest.raises(flags.IllegalFlagValueError):
        FLAGS(["tfscale-train", "--heartbeat_timeout=0.5"])
    assert "heartbeat_timeout" not in train_flags.LOCAL_FLAGS
    assert FLAGS["heartbeat_timeout"].default == tfscale.startup.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS


@pytest.mark.parametrize("tf_config, cluster_resolver, evaluates", [
    ({"cluster": {"chief": ["a:1"], "worker": ["b:1"], "evaluator": ["c:1"]},
      "task": {"type": "evaluator", "index": 0}}, "tf_config", True),  # as Kubeflow writes it
    ({"cluster": {"chief": ["a:1"], "worker": ["b:1"], "evaluator": ["c:1"]},
      "task": {"type": "chief", "index": 0}}, "tf_config", False),
    (None, "tf_config", False),  # alone
    ({"cluster": {"worker": ["b:1"], "evaluator": ["c:1"]},
      "task": {"type": "evaluator", "index": 0}}, "slurm", False),  # SLURM's cluster wins
])
def test_the_evaluator_role_comes_from_tf_config_as_tensorflow_reads_it(
        monkeypatch, tf_config, cluster_resolver, evaluates):
    import tensorflow as tf

    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    FLAGS.unparse_flags()
    FLAGS(["tfscale-train", f"--cluster_resolver={cluster_resolver}"])
    assert train_flags.is_evaluator(train_flags.Config.from_flags()) == evaluates
    if cluster_resolver == "tf_config":  # what the library's strategy reads
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        assert (resolver.task_type == "evaluator") == evaluates


@pytest.mark.parametrize("args, size, options", [
    ([], 67, {"fc_units": 512}),  # AlexNet-BN's smallest input, upsampled digits
    (["--model=alexnet_bn_small"], 8, {}),  # the digits' own 8x8, the model's 64 units
    (["--model=alexnet_bn_small", "--dataset=fashion_mnist"], 28, {}),
    (["--model=alexnet_bn_small", "--fc_units=16", "--image_size=12"], 12, {"fc_units": 16}),
    (["--model=alexnet_bn_small", "--dataset=synthetic"], 224, {}),  # no stored size
    (["--model=resnet50", "--dataset=imagenet"], 224, {}),
])
def test_each_model_gets_its_input_size_and_width_from_the_flags(args, size, options):
    from tfscale import dataset_specs
    from tfscale.launch import training

    parse(*args)
    assert training.model_input_size(FLAGS, dataset_specs.spec(FLAGS.dataset)) == size
    assert training.model_options(FLAGS) == options
