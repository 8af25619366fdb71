r"""Optimizer, learning-rate schedule and precision flags of tfscale-train.

Importing this module defines the flags; `launch/train.py` keeps
`--learning_rate` and `--momentum`, which this module reads. The defaults
reproduce plain SGD with momentum 0.9 at a constant learning rate in float32.

    tfscale-train --optimizer=lars --lr_schedule=warmup_poly --warmup_epochs=2 \
        --learning_rate=0.1 --scale_lr --weight_decay=5e-5 \
        --precision=mixed_bfloat16
    tfscale-train --recipe=resnet50_lars_32k --model=resnet50 --dataset=imagenet

Weight decay (`--weight_decay=wd`) has one meaning for both optimizers: L2
added to the gradient before the update, `g <- g + wd * w`, for every
variable except biases and BatchNorm parameters (tfscale LARS's default
exclusions). With LARS it is `weight_decay_rate` and enters the trust ratio;
with SGD it is LARS with every trust ratio fixed at 1, which is exactly SGD
with momentum on the decayed gradient (`v = m * v + lr * g; w = w - v`).
An L2 term `wd / 2 * ||w||^2` in the loss would give the same gradient.

A `--recipe` sets published hyper-parameters; flags given on the command
line still win. Each recipe's `base_batch_size` is the batch its learning
rate was published for, so `--scale_lr` scales it linearly to yours.
"""

import dataclasses

from absl import flags

OPTIMIZERS = ("sgd", "lars")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
LR_SCHEDULES = ("constant", "warmup_poly", "one_cycle")

# Published large-batch settings. Each number is copied from the source named
# in the comment next to it; where a source gives no value the key is absent
# and the flag's own value applies.
RECIPES = {
    # MLPerf Training v0.6, Google's ResNet-50 submission at batch 32K
    # (mlcommons/training_results_v0.6,
    # Google/benchmarks/resnet/tpu-v3-1024/run_and_time.sh and its
    # implementations/tpu-v3-1024-resnet/resnet/lars_util.py). Published but
    # not set here: --label_smoothing=0.1 (tfscale-train has no label
    # smoothing) and --train_steps=2983 (about 76 epochs: set --epochs). That
    # code also adds weight_decay * l2 to the loss; tfscale applies it once.
    "resnet50_lars_32k": {
        "optimizer": "lars",  # --enable_lars=True
        "base_batch_size": 32768,  # --train_batch_size=32768
        "learning_rate": 31.2,  # --lars_base_learning_rate=31.2
        "warmup_epochs": 25.0,  # --lars_warmup_epochs=25
        "weight_decay": 1e-4,  # --weight_decay=0.0001
        "lars_epsilon": 1e-5,  # --lars_epsilon=1e-05
        # resnet_main.py: flags.DEFINE_float('momentum', default=0.9).
        "momentum": 0.9,
        # lars_util.py passes no eeta: tf.contrib.opt.LARSOptimizer's
        # default, eeta=0.001.
        "eeta": 0.001,
        "lr_schedule": "warmup_poly",  # lars_util.py: poly_rate_schedule
        "poly_power": 2.0,  # lars_util.py: polynomial_decay(..., power=2.0)
        # lars_util.py logs lars_opt_end_learning_rate 0.0001 (the default
        # end_learning_rate of tf.train.polynomial_decay, which it calls).
        "end_learning_rate": 1e-4,
    },
    # MLPerf Training v1.0 reference, ResNet-50 with LARS at batch 4K on
    # TPU-v3-64 (mlcommons/training, image_classification/
    # README_tensorflow2.md, tensorflow2/lars_util.py, lars_optimizer.py).
    # Published but not set: --label_smoothing=0.1, --train_epochs=42.
    "resnet50_lars_4k": {
        "optimizer": "lars",  # --optimizer=LARS
        "base_batch_size": 4096,  # --batch_size=4096
        "learning_rate": 10.0,  # --base_learning_rate=10.0
        "warmup_epochs": 5.0,  # --warmup_epochs=5
        "weight_decay": 2e-4,  # --weight_decay=0.0002
        "lars_epsilon": 0.0,  # --lars_epsilon=0
        "momentum": 0.9,  # --momentum=0.9
        "eeta": 0.001,  # lars_optimizer.py: LARSOptimizer(eeta=0.001)
        "lr_schedule": "warmup_poly",  # --lr_schedule=polynomial
        "poly_power": 2.0,  # lars_util.py: PolynomialDecay(power=2.0)
        # lars_util.py: end_learning_rate defaults to 0.0001.
        "end_learning_rate": 1e-4,
    },
    # AlexNet-BN with LARS at 8K, from the NVCaffe solver of Boris Ginsburg
    # (a LARS author): borisgin/nvcaffe, models/alexnet_bn/solver_8K.prototxt.
    # You et al. 2017 (arXiv 1708.03888) report these runs, but the paper's
    # own tables were not available to check against. NVCaffe differs in
    # schedule shape: its warmup starts at rampup_lr=1 (not 0), its poly decay
    # counts from step 0, not from the end of the warmup, and this file uses
    # LARC's "clip" policy where tfscale's LARS scales.
    "alexnet_bn_lars_8k": {
        "optimizer": "lars",  # larc: true
        "base_batch_size": 8192,  # base_lr: 10  # B=8K
        "learning_rate": 10.0,  # base_lr: 10
        "eeta": 0.001,  # larc_eta: 0.001
        # rampup_interval: 600 iterations at 8192 images of 1,281,167.
        "warmup_epochs": round(600 * 8192 / 1281167, 2),
        "lr_schedule": "warmup_poly",  # lr_policy: "poly"
        "poly_power": 2.0,  # power: 2.
        # Caffe's poly policy reaches 0 at max_iter (15600, "100 epochs").
        "end_learning_rate": 0.0,
        "momentum": 0.9,  # momentum: 0.9
        "weight_decay": 5e-4,  # weight_decay: 0.0005
    },
    # AlexNet-BN with LARS at 32K: borisgin/nvcaffe,
    # models/alexnet_bn/solver_32k.prototxt (same caveats as 8K; this file
    # uses local_lr_auto, i.e. LARS scaling, not LARC clipping).
    "alexnet_bn_lars_32k": {
        "optimizer": "lars",  # local_lr_auto: true
        "base_batch_size": 32768,  # base_lr: 32  # B=32K
        "learning_rate": 32.0,  # base_lr: 32
        "eeta": 0.001,  # local_gw_ratio: 0.001
        # rampup_interval: 400 iterations ("10 epochs") at 32768 images.
        "warmup_epochs": round(400 * 32768 / 1281167, 2),
        "lr_schedule": "warmup_poly",  # lr_policy: "poly"
        "poly_power": 2.0,  # power: 2.
        # Caffe's poly policy reaches 0 at max_iter (4000, "100 epochs").
        "end_learning_rate": 0.0,
        "momentum": 0.9,  # momentum: 0.9
        "weight_decay": 5e-4,  # weight_decay: 0.0005
    },
}
# Jia et al. 2018 (arXiv 1807.11205) trained AlexNet-BN for 95 epochs and
# ResNet-50 for 90 epochs at batch 64K (abstract); their learning rates and
# warmup lengths were not found in the sources available, so there is no
# 64K recipe.

flags.DEFINE_enum("optimizer", "sgd", OPTIMIZERS,
                  "sgd: momentum SGD; lars: tfscale.optimizers.LARS.")
flags.DEFINE_enum(
    "precision", "float32", PRECISIONS,
    "Keras dtype policy. mixed_bfloat16 is the fast choice on CPUs with "
    "bfloat16 instructions; mixed_float16 (GPUs) adds dynamic loss scaling "
    "that agrees across workers.",
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


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that decides the optimizer, its schedule and precision.

    The fields mirror the flags of the same name; `learning_rate` and
    `momentum` are tfscale-train's flags. Defaults are tfscale-train's.
    """

    optimizer: str = "sgd"
    precision: str = "float32"
    learning_rate: float = 0.05
    momentum: float = 0.9
    lr_schedule: str = "constant"
    warmup_epochs: float = 0.0
    end_learning_rate: float = 0.0
    poly_power: float = 2.0
    weight_decay: float = 0.0
    scale_lr: bool = False
    base_batch_size: int = 256
    eeta: float = 0.001
    lars_epsilon: float = 0.0
    recipe: str = "none"

    def __post_init__(self):
        for name, allowed in (("optimizer", OPTIMIZERS),
                              ("precision", PRECISIONS),
                              ("lr_schedule", LR_SCHEDULES),
                              ("recipe", ("none", *RECIPES))):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"`{name}` must be one of {list(allowed)}. "
                    f"Received: {name}={value!r}"
                )
        if self.learning_rate <= 0:
            raise ValueError("`learning_rate` must be > 0. "
                             f"Received: learning_rate={self.learning_rate!r}")

    def peak_learning_rate(self, global_batch_size):
        """The learning rate after warmup (linearly scaled with --scale_lr)."""
        if not self.scale_lr:
            return float(self.learning_rate)
        from tfscale import schedules

        return schedules.linear_scaling(
            self.learning_rate, global_batch_size, self.base_batch_size)


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


def make_schedule(settings, global_batch_size, steps_per_epoch, epochs):
    """The learning rate (a float or a `LearningRateSchedule`) of `settings`."""
    from tfscale import schedules

    peak = settings.peak_learning_rate(global_batch_size)
    total_steps = steps_per_epoch * epochs
    warmup_steps = schedules.epochs_to_steps(settings.warmup_epochs,
                                             steps_per_epoch)
    if settings.lr_schedule == "constant":
        if warmup_steps == 0:
            return peak
        return schedules.Warmup(peak, warmup_steps)
    if settings.lr_schedule == "warmup_poly":
        if warmup_steps >= total_steps:
            raise ValueError(
                "`warmup_epochs` must be shorter than training for "
                "lr_schedule='warmup_poly'. Received: "
                f"warmup_epochs={settings.warmup_epochs!r}, epochs={epochs!r}"
            )
        return schedules.WarmupPolynomialDecay(
            initial_learning_rate=peak,
            decay_steps=total_steps,
            warmup_steps=warmup_steps,
            end_learning_rate=settings.end_learning_rate,
            power=settings.poly_power,
        )
    pct_start = settings.warmup_epochs / epochs if warmup_steps else 0.3
    if not 0 < pct_start < 1:
        raise ValueError(
            "`warmup_epochs` must be shorter than training for "
            f"lr_schedule='one_cycle'. Received: "
            f"warmup_epochs={settings.warmup_epochs!r}, epochs={epochs!r}"
        )
    return schedules.OneCycle(peak, total_steps, pct_start=pct_start)


def make_optimizer(settings, global_batch_size, steps_per_epoch, epochs):
    """The Keras optimizer and its learning rate described by `settings`.

    Under `mixed_float16` the optimizer is wrapped in
    `tfscale.optimizers.LossScaleOptimizer` (Keras's `compile` would
    otherwise wrap it in its own, which deadlocks across workers when one
    overflows). Build it inside `strategy.scope()`.

    Returns:
        `(optimizer, learning_rate)`: the optimizer to pass to `compile`,
        and the float or `LearningRateSchedule` it uses.
    """
    import keras

    from tfscale import optimizers

    learning_rate = make_schedule(
        settings, global_batch_size, steps_per_epoch, epochs)
    if settings.optimizer == "lars":
        optimizer = optimizers.LARS(
            learning_rate=learning_rate,
            momentum=settings.momentum,
            weight_decay_rate=settings.weight_decay,
            eeta=settings.eeta,
            epsilon=settings.lars_epsilon,
        )
    elif settings.weight_decay:
        # Trust ratio 1 everywhere: SGD with momentum on g + wd * w, with
        # LARS's exclusion of biases and BatchNorm from the decay.
        optimizer = optimizers.LARS(
            learning_rate=learning_rate,
            momentum=settings.momentum,
            weight_decay_rate=settings.weight_decay,
            exclude_from_layer_adaptation=[".*"],
            name="SGD",
        )
    else:
        optimizer = keras.optimizers.SGD(
            learning_rate=learning_rate, momentum=settings.momentum)
    if settings.precision == "mixed_float16":
        optimizer = optimizers.LossScaleOptimizer(optimizer)
    return optimizer, learning_rate


def build_optimizer(global_batch_size, steps_per_epoch, epochs):
    """`make_optimizer` with the settings of the parsed flags."""
    return make_optimizer(settings_from_flags(), global_batch_size,
                          steps_per_epoch, epochs)


def describe(global_batch_size=None, settings=None):
    """One line saying which optimizer, schedule and precision are in use."""
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
    if s.recipe != "none":
        parts.append(f", recipe {s.recipe}")
    return "".join(parts)
