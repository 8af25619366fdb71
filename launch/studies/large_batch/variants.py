"""The study's settings, and `Variant`: one setting at one learning rate.

A variant turns the flags into what one run trains: its batch, its steps
per epoch, its `recipes.Settings` (AlexNet-BN) and the label the report
prints.
"""

import dataclasses

from absl import flags

from tfscale import recipe_settings
# Not `from tfscale import batch_growth`: a public name of `tfscale` loads
# all of it, TensorFlow included, and the flags are checked before that.
from tfscale.batch_growth import parse as parse_batch_schedule

ALEXNET_SETTINGS = ("sgd_small", "sgd_large", "lars_large",
                    "slow_start_large", "rmsprop_warmup_large",
                    "lr_decay_small", "batch_growth_small",
                    "powersgd_sgd_small", "powersgd_lars_large")
SOFTMAX_SETTINGS = tuple(f"softmax_{method}_{size}"
                         for method in ("sgd", "lp_sgd", "svrg", "halp")
                         for size in ("small", "large"))
SETTINGS = ALEXNET_SETTINGS + SOFTMAX_SETTINGS

FLAGS = flags.FLAGS

NUM_TRAIN = 1437  # digits' training split (tfscale.data)
# Bits of the softmax group's low-precision runs (LP-SGD, HALP).
BITS = 8
# Akiba et al.'s run is 90 epochs; RMSpropWarmup's defaults (center 10,
# period 5 epochs) are kept as fractions of it.
_AKIBA_EPOCHS = 90.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One setting at one learning rate."""

    setting: str
    learning_rate: float
    powersgd_rank: int = 0  # 0: gradients all-reduced uncompressed

    @property
    def large(self):
        return self.setting.endswith("_large")

    @property
    def softmax(self):
        return self.setting.startswith("softmax_")

    @property
    def grows(self):
        """Whether it runs under --batch_growth's events."""
        return self.setting in ("lr_decay_small", "batch_growth_small")

    @property
    def uncompressed(self):
        """The same run without PowerSGD (itself when uncompressed)."""
        setting = {"powersgd_sgd_small": "sgd_small",
                   "powersgd_lars_large": "lars_large"}.get(self.setting, self.setting)
        return Variant(setting, self.learning_rate)

    @property
    def method(self):
        """The softmax group's optimizer: sgd, lp_sgd, svrg or halp."""
        return self.setting[len("softmax_"):].rsplit("_", 1)[0]

    @property
    def batch(self):
        return FLAGS.large_batch if self.large else FLAGS.small_batch

    @property
    def steps_per_epoch(self):
        return max(1, round(NUM_TRAIN / self.batch))

    def settings(self, precision):
        """The `tfscale.recipes.Settings` of this AlexNet-BN variant."""
        common = dict(
            precision=precision, momentum=FLAGS.momentum,
            lr_schedule="warmup_poly", end_learning_rate=0.0, poly_power=2.0,
            weight_decay=FLAGS.weight_decay,
            warmup_epochs=FLAGS.warmup_epochs if self.large else 0.0,
        )
        if self.uncompressed.setting == "lars_large":
            return recipe_settings.Settings(
                optimizer="lars", learning_rate=self.learning_rate, **common)
        # Linear scaling from the small batch (a no-op for the baseline).
        common.update(learning_rate=self.learning_rate, scale_lr=True,
                      base_batch_size=FLAGS.small_batch)
        if self.setting == "slow_start_large":
            common["lr_schedule"] = "slow_start"
        if self.grows:
            # A limit of the first batch turns every growth into a decay.
            common.update(
                lr_schedule="constant", batch_schedule=FLAGS.batch_growth,
                max_global_batch_size=(FLAGS.small_batch
                                       if self.setting == "lr_decay_small"
                                       else 0))
        if self.setting == "rmsprop_warmup_large":
            fraction = FLAGS.epochs / _AKIBA_EPOCHS
            common.update(
                lr_schedule="slow_start", warmup_epochs=0.0,
                rmsprop_warmup_center_epochs=10.0 * fraction,
                rmsprop_warmup_period_epochs=5.0 * fraction)
            return recipe_settings.Settings(optimizer="rmsprop_warmup", **common)
        return recipe_settings.Settings(optimizer="sgd", **common)

    @property
    def peak_learning_rate(self):
        if self.softmax:
            return self.learning_rate
        return self.settings("float32").peak_learning_rate(self.batch)

    @property
    def label(self):
        if self.powersgd_rank:
            return (f"{self.uncompressed.label}, PowerSGD rank "
                    f"{self.powersgd_rank}")
        scaled = (f"lr {self.learning_rate:g} x {self.batch}/"
                  f"{FLAGS.small_batch}")
        if self.softmax:
            name = {"sgd": "SGD, float32", "lp_sgd": f"LP-SGD, {BITS}-bit",
                    "svrg": "SVRG, float32",
                    "halp": f"HALP, {BITS}-bit"}[self.method]
            return f"{name}, batch {self.batch}, lr {self.learning_rate:g}"
        if self.setting == "sgd_small":
            return f"SGD, batch {self.batch}, lr {self.learning_rate:g}"
        if self.setting == "sgd_large":
            return f"SGD, batch {self.batch}, {scaled} + warmup"
        if self.setting == "slow_start_large":
            return f"SGD, batch {self.batch}, {scaled}, warmup + slow start"
        if self.setting == "rmsprop_warmup_large":
            return f"RMSprop warm-up, batch {self.batch}, {scaled}, slow start"
        if self.setting == "lars_large":
            return (f"LARS, batch {self.batch}, lr {self.learning_rate:g} "
                    "+ warmup")
        events = parse_batch_schedule(FLAGS.batch_growth)
        at = ", ".join(str(epoch) for epoch, _ in events)
        factor = "x".join(str(factor) for _, factor in events)
        if self.setting == "batch_growth_small":
            return (f"SGD, batch {self.batch} grown {factor} at epochs {at}, "
                    f"lr {self.learning_rate:g}")
        return (f"SGD, batch {self.batch}, lr {self.learning_rate:g} "
                f"/ {factor} at epochs {at}")

    def precisions(self):
        """The policies it runs under: the softmax group only in float32."""
        return ("float32",) if self.softmax else tuple(FLAGS.precisions)


def from_flags():
    """Every variant the flags ask for, in the order of --settings."""
    result = []
    for setting in FLAGS.settings:
        if setting.startswith("softmax_"):
            rates = [FLAGS.softmax_large_learning_rate
                     if setting.endswith("_large")
                     else FLAGS.softmax_learning_rate]
        elif setting == "lars_large":
            rates = FLAGS.lars_learning_rates
        elif setting == "powersgd_sgd_small":
            rates = [FLAGS.powersgd_learning_rate]
        elif setting == "powersgd_lars_large":
            rates = [FLAGS.powersgd_lars_learning_rate]
        else:
            rates = FLAGS.learning_rates
        ranks = ([int(r) for r in FLAGS.powersgd_ranks]
                 if setting.startswith("powersgd_") else [0])
        result += [Variant(setting, float(rate), rank)
                   for rate in rates for rank in ranks]
    return result

