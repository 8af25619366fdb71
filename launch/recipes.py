"""What decides the optimizer, its schedule and precision: `Settings`,
published `RECIPES`, and the functions that turn them into Keras objects.

Free of flags, so scripts other than tfscale-train can use it
(`launch.optimization` maps tfscale-train's flags onto it).

Weight decay (`Settings.weight_decay = wd`) has one meaning for both
optimizers: L2 added to the gradient before the update, `g <- g + wd * w`,
for every variable except biases and BatchNorm parameters (tfscale LARS's
default exclusions). With LARS it is `weight_decay_rate` and enters the
trust ratio; with SGD it is LARS with every trust ratio fixed at 1, which is
exactly SGD with momentum on the decayed gradient
(`v = m * v + lr * g; w = w - v`). An L2 term `wd / 2 * ||w||^2` in the loss
would give the same gradient.
"""

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that decides the optimizer, its schedule and precision.

    The fields mirror tfscale-train's flags of the same name, and the
    defaults are its defaults (plain SGD, momentum 0.9, constant 0.05,
    float32).

    Attributes:
        optimizer: "sgd" or "lars".
        precision: Keras dtype policy, one of `PRECISIONS`.
        learning_rate: the peak learning rate (after warmup), for
            `base_batch_size` examples if `scale_lr`.
        momentum: momentum of SGD and LARS.
        lr_schedule: one of `LR_SCHEDULES` (see `make_schedule`).
        warmup_epochs: length of the linear warmup.
        end_learning_rate: "warmup_poly": the learning rate at the end.
        poly_power: "warmup_poly": the power of the decay.
        weight_decay: L2 on the gradient, biases and BatchNorm excluded.
        scale_lr: apply the linear scaling rule from `base_batch_size`.
        base_batch_size: the batch `learning_rate` is given for.
        eeta: LARS trust coefficient.
        lars_epsilon: LARS: added to the gradient norm in the trust ratio.
        recipe: name of the `RECIPES` entry the values came from, or "none".
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


def make_schedule(settings, global_batch_size, steps_per_epoch, epochs):
    """The learning rate (a float or a `LearningRateSchedule`) of `settings`.

    - "constant": the peak learning rate, after a linear warmup from 0 over
      `warmup_epochs` if that is > 0.
    - "warmup_poly": linear warmup from 0 to the peak, then polynomial decay
      to `end_learning_rate` at the last step (MLPerf's LARS schedule).
    - "one_cycle": cosine up to the peak over `warmup_epochs` (0: the first
      30% of training), cosine down after.

    Args:
        settings: a `Settings`.
        global_batch_size: examples per step over all workers.
        steps_per_epoch: optimizer steps per epoch.
        epochs: the length of training; the schedule ends with it.
    """
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
