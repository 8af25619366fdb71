r"""Optimizer, learning-rate schedule and precision flags of tfscale-train.

Importing this module defines the flags; `launch/train.py` keeps
`--learning_rate` and `--momentum`, which this module reads. The defaults
reproduce plain SGD with momentum 0.9 at a constant learning rate in float32.

    tfscale-train --optimizer=lars --lr_schedule=warmup_poly --warmup_epochs=2 \
        --learning_rate=0.1 --scale_lr --weight_decay=5e-5 \
        --precision=mixed_bfloat16
    tfscale-train --recipe=resnet50_lars_32k --model=resnet50 --dataset=imagenet

`--weight_decay=wd` is L2 added to the gradient, `g <- g + wd * w`, of every
variable but biases and BatchNorm parameters, for SGD and LARS alike (see
launch/recipes.py, which also holds the recipes and their sources).

A `--recipe` sets published hyper-parameters; flags given on the command
line still win. Each recipe's `base_batch_size` is the batch its learning
rate was published for, so `--scale_lr` scales it linearly to yours.
"""

import dataclasses

from absl import flags

from launch.recipes import LR_SCHEDULES
from launch.recipes import OPTIMIZERS
from launch.recipes import PRECISIONS
from launch.recipes import RECIPES
from launch.recipes import Settings
from launch.recipes import make_optimizer

flags.DEFINE_enum("optimizer", "sgd", OPTIMIZERS,
                  "sgd: momentum SGD; lars: tfscale.optimizers.LARS.")
flags.DEFINE_enum(
    "precision", "float32", PRECISIONS,
    "Keras dtype policy. mixed_bfloat16 speeds up CPUs with AVX-512 "
    "(oneDNN bfloat16 kernels) but is 6-14x SLOWER on CPUs without it, "
    "where TensorFlow falls back to Eigen (launch/precision_speed.py "
    "measures yours); mixed_float16 is for GPUs and adds dynamic loss "
    "scaling that agrees across workers.",
)
flags.DEFINE_enum(
    "lr_schedule", "constant", LR_SCHEDULES,
    "constant: the learning rate throughout (after --warmup_epochs of linear "
    "warmup if > 0); warmup_poly: linear warmup, then polynomial decay to "
    "--end_learning_rate over the remaining epochs (MLPerf LARS); one_cycle: "
    "cosine up to the learning rate over --warmup_epochs (0: 30% of "
    "training), then cosine down.",
)
flags.DEFINE_float("warmup_epochs", 0.0, "Linear warmup length in epochs.",
                   lower_bound=0.0)
flags.DEFINE_float("end_learning_rate", 0.0,
                   "warmup_poly: the learning rate at the last step.",
                   lower_bound=0.0)
flags.DEFINE_float("poly_power", 2.0, "warmup_poly: power of the decay.",
                   lower_bound=0.0)
flags.DEFINE_float(
    "weight_decay", 0.0,
    "L2 added to the gradient (g + wd * w) of every variable but biases and "
    "BatchNorm parameters, for sgd and lars alike.",
    lower_bound=0.0,
)
flags.DEFINE_bool(
    "scale_lr", False,
    "Linear scaling rule: use learning_rate * global_batch_size / "
    "base_batch_size as the (peak) learning rate.",
)
flags.DEFINE_integer("base_batch_size", 256,
                     "The batch --learning_rate is given for (--scale_lr).",
                     lower_bound=1)
flags.DEFINE_float("eeta", 0.001, "lars: trust coefficient.", lower_bound=0.0)
flags.DEFINE_float("lars_epsilon", 0.0,
                   "lars: added to the gradient norm in the trust ratio.",
                   lower_bound=0.0)
flags.DEFINE_enum(
    "recipe", "none", ["none", *RECIPES],
    "Published large-batch hyper-parameters (see launch/optimization.py for "
    "their sources); flags given explicitly override them.",
)
FLAGS = flags.FLAGS


def settings_from_flags():
    """`Settings` from the parsed flags, the `--recipe` filling the rest.

    A flag given on the command line wins over the recipe; the recipe wins
    over the flag's default.
    """
    recipe = RECIPES.get(FLAGS.recipe, {})
    values = {}
    for field in dataclasses.fields(Settings):
        name = field.name
        if name in recipe and not FLAGS[name].present:
            values[name] = recipe[name]
        else:
            values[name] = FLAGS[name].value
    return Settings(**values)


def set_precision(settings=None):
    """Sets Keras's global dtype policy from `--precision`.

    Call it before building the model: layers take the policy when created.
    """
    import keras

    settings = settings or settings_from_flags()
    keras.mixed_precision.set_global_policy(settings.precision)


def build_optimizer(global_batch_size, steps_per_epoch, epochs):
    """The optimizer the parsed flags describe; build it in the strategy scope.

    Args:
        global_batch_size: examples per step over all workers.
        steps_per_epoch: optimizer steps per epoch.
        epochs: the length of training; decaying schedules end with it.

    Returns:
        `(optimizer, learning_rate)`, as `launch.recipes.make_optimizer`:
        under `--precision=mixed_float16` the optimizer is wrapped in
        `tfscale.optimizers.LossScaleOptimizer`.
    """
    return make_optimizer(settings_from_flags(), global_batch_size,
                          steps_per_epoch, epochs)


def describe(global_batch_size=None, settings=None):
    """One line saying which optimizer, schedule and precision are in use.

    Args:
        global_batch_size: shows the linearly scaled learning rate if given.
        settings: a `Settings`; defaults to the parsed flags'.
    """
    s = settings or settings_from_flags()
    parts = [f"optimizer {s.optimizer} (momentum {s.momentum:g}"]
    if s.weight_decay:
        parts.append(f", weight decay {s.weight_decay:g} except bias/BN")
    if s.optimizer == "lars":
        parts.append(f", eeta {s.eeta:g}")
        if s.lars_epsilon:
            parts.append(f", epsilon {s.lars_epsilon:g}")
    parts.append(f"), lr {s.lr_schedule} ")
    if s.scale_lr and global_batch_size:
        peak = s.peak_learning_rate(global_batch_size)
        parts.append(f"{peak:g} (= {s.learning_rate:g} x {global_batch_size}"
                     f"/{s.base_batch_size})")
    elif s.scale_lr:
        parts.append(f"{s.learning_rate:g} x batch/{s.base_batch_size}")
    else:
        parts.append(f"{s.learning_rate:g}")
    if s.warmup_epochs:
        parts.append(f", warmup {s.warmup_epochs:g} epochs")
    if s.lr_schedule == "warmup_poly":
        parts.append(f", power {s.poly_power:g} to {s.end_learning_rate:g}")
    parts.append(f", precision {s.precision}")
    if s.precision == "mixed_float16":
        parts.append(" with dynamic loss scaling")
    if s.recipe != "none":
        parts.append(f", recipe {s.recipe}")
    return "".join(parts)
