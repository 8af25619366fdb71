"""`CommunicationOptions` and `PowerSGDOptions`: how `tfscale.Strategy`
all-reduces, validated from the tables below (as `tfscale.recipes.Settings`
is), frozen, and serializable (`get_config`, `from_config`)."""

import dataclasses
import os

import tensorflow as tf

from tfscale import _validation
from tfscale.collectives import autotune as autotune_lib
from tfscale.collectives import cost_model as cost_model_lib
from tfscale.collectives import implementation as implementation_lib
from tfscale.collectives import powersgd as powersgd_lib
from tfscale.collectives.plan import ALGORITHMS
from tfscale.collectives.plan import COMPRESSIONS

_MiB = 1024 * 1024
# What `CommunicationOptions(compression=...)` takes: a 16-bit wire dtype, or
# PowerSGD's low-rank factors.
COMPRESSION_CHOICES = (*COMPRESSIONS, powersgd_lib.NAME)


def _integer(minimum):
    return lambda v: _validation.is_int(v) and v >= minimum


def _number(minimum, strict=False):
    return lambda v: (_validation.is_finite_number(v)
                      and (v > minimum if strict else v >= minimum))


def _check(name, value, rule, ok, none_means=None):
    """Raises ValueError naming `name` and `rule` unless `ok(value)` (or the
    value is None where `none_means` says what None does)."""
    if value is None and none_means is not None:
        return
    if not ok(value):
        none = f", or None {none_means}" if none_means else ""
        raise ValueError(f"Argument `{name}` must be {rule}{none}. "
                         f"Received: {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class PowerSGDOptions:
    """PowerSGD's settings (Vogels, Karimireddy and Jaggi 2019; the names of
    PyTorch's `PowerSGDState` in brackets).

    Args:
        rank: the rank r of the factors (`matrix_approximation_rank`).
        start_step: optimizer updates all-reduced uncompressed before
            compression starts (`start_powerSGD_iter`).
        min_compression_rate: a matrix is compressed only if it shrinks at
            least this many times, else it is all-reduced as it is
            (`min_compression_rate`).
        bucket_bytes: gradient bytes per bucket of matrices compressed and
            all-reduced together, last layer first; each bucket starts as
            soon as backprop has produced its gradients (PyTorch's hook runs
            per DDP bucket, `bucket_cap_mb`). `None` (default): one bucket,
            after the last gradient: where workers share CPU cores there is
            no idle core to overlap with, and each bucket adds two rounds of
            all-reduces (`tfscale-bench train --compression=powersgd
            --powersgd_bucket_bytes=...` measures buckets on your cluster).
    """

    rank: int = powersgd_lib.DEFAULT_RANK
    start_step: int = powersgd_lib.DEFAULT_START_STEP
    min_compression_rate: float = powersgd_lib.DEFAULT_MIN_COMPRESSION_RATE
    bucket_bytes: int | None = None

    # (field, rule, check) of each argument.
    _RULES = (
        ("rank", "an integer >= 1 (the rank of the factors)", _integer(1)),
        ("start_step", "an integer >= 0 (optimizer updates all-reduced "
         "uncompressed before PowerSGD starts)", _integer(0)),
        ("min_compression_rate", "a number >= 1 (a matrix is compressed only if "
         "it shrinks at least this many times)", _number(1)),
    )
    # (field, rule, check) of each argument that may also be None.
    _OPTIONAL_RULES = (
        ("bucket_bytes", "an integer >= 0 (gradient bytes per bucket)", _integer(0),
         "for one bucket"),
    )

    def __post_init__(self):
        for name, rule, ok in self._RULES:
            _check(name, getattr(self, name), rule, ok)
        for name, rule, ok, none_means in self._OPTIONAL_RULES:
            _check(name, getattr(self, name), rule, ok, none_means)
        object.__setattr__(self, "min_compression_rate",
                           float(self.min_compression_rate))

    def get_config(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How `tfscale.Strategy` all-reduces.

    Gradients are packed, last layer first, into buffers of about
    `fusion_threshold_bytes` (tensor fusion); each buffer is all-reduced on
    its own, by the algorithm chosen for it:

    - `"ring"`: one flat ring through all workers. Bandwidth-optimal; its
      2(n-1) latency steps all cross the slowest link.
    - `"hierarchical"`: all-reduce inside each node, all-reduce among the
      node leaders, broadcast inside each node (Jia et al. 2018, 4.2). Fewer
      latency steps, and only one stream per node leaves the node.
    - `"2d"`: all-reduce inside each node, then each worker all-reduces its
      1/k shard with the workers of the same local rank in the other nodes,
      then an all-gather inside the node. Nodes must have equal sizes.
    - `"halving_doubling"`: recursive halving, then recursive doubling, over
      pairs of workers (Thakur, Rabenseifner and Gropp 2005; Goyal et al.
      2017): 2 log2(n) latency steps instead of the ring's 2(n-1), the same
      bytes; any number of workers (2 more steps when n is not a power of
      two).
    - `"hybrid"`: per buffer, `"hierarchical"` below `hybrid_threshold_bytes`
      and `"ring"` at or above it (Jia et al. 2018, 4.3); without a
      threshold, the faster of ring and hierarchical by `cost_model`'s
      prediction (halving_doubling, measured slower on this runtime, is
      not among its choices: BENCHMARKS.md, section "The fixed cost of
      one collective").
    - `"auto"` (the default over TensorFlow's ring): per buffer, the
      fastest of ring, hierarchical and 2d as measured by the job itself:
      during the first steps each buffer runs each of them in turn on its
      real gradients (one warm-up and `autotune.ROUNDS` timed steps each),
      the buffers one after another as a fixed algorithm's run. Each
      buffer's fastest is the one with the least time (per step the least
      over the workers, about the one ready last; they agree by one
      all-reduce of the times); where buffers could differ, that mix runs
      `autotune.ROUNDS` steps too. It tries the plan at
      `fusion_threshold_bytes` and at a quarter of it (smaller buffers
      start during backprop, at more ops each step), taking turns, and
      keeps the threshold and configuration (one candidate for every
      buffer, or the mix) that left the least from the first gradient
      ready to the last result. Then `fit` has Keras trace its train
      function again, and the choice runs as a fixed plan would (a custom
      loop builds its `tf.function` anew when
      `strategy.autotune.retrace_due()`). The chief logs the choice and,
      given `autotune_dir`, stores it there; a restart reuses it without
      trials. `cost_model` orders the trials and breaks ties.
      Nothing to try with one node or one worker per node (a ring); inside
      XLA or under op determinism no trials (the cost model's choice). See
      `tfscale.collectives.autotune`.

    With one node, or one worker per node, "hierarchical" and "2d" run as a
    ring.
    The plan (each buffer's size and algorithm) is logged once on the chief.

    Args:
        algorithm: `"hybrid"`, `"ring"`, `"hierarchical"`, `"2d"`,
            `"halving_doubling"` or `"auto"`. `None` (default): `"auto"` over
            TensorFlow's ring (a ring on one node), `"ring"` over NCCL (one
            NCCL all-reduce per buffer over all workers; NCCL picks its ring
            or tree), the path most run by others until tfscale's own have
            run on GPUs; `"hybrid"` when `hybrid_threshold_bytes` is given
            (`collectives.implementation.default_algorithm`).
        fusion_threshold_bytes: buffer size at which a fused buffer is closed
            and sent; 0 sends each tensor on its own. Under `"auto"` (where it
            has candidates) also a quarter of it is tried, and the faster
            kept.
        hybrid_threshold_bytes: `"hybrid"` only: bytes on the wire at which a
            buffer goes by ring instead of hierarchical. `None`: each buffer
            takes the algorithm `cost_model` predicts fastest.
        local_size: workers per node. `None`: workers on the same host in
            TF_CONFIG form a node. Otherwise consecutive workers are grouped
            `local_size` at a time (4 workers on one host with `local_size=2`
            act as 2 nodes of 2); the last node is smaller when it does not
            divide the number of workers.
        compression: `None`, `"bfloat16"`, `"float16"` or `"powersgd"`.
            `"bfloat16"`, `"float16"`: float32 buffers
            travel and are summed in that 16-bit type and come back float32
            (half the bytes; on n workers an error of at most about n * 2**-8
            (bfloat16) or n * 2**-11 (float16) times the sum of the values'
            magnitudes). bfloat16 keeps
            float32's range; float16 is scaled per buffer so its sum cannot
            overflow. Other dtypes, and lone scalars (losses, metrics), travel
            as they are. See
            `tfscale.collectives.compression`.
            `"powersgd"`: each float32 gradient matrix (conv kernels
            reshaped) travels as two rank-`powersgd.rank` factors, with the
            compression error kept on each worker and added to its next
            gradient (Vogels et al. 2019; PyTorch's `powerSGD_hook`); see
            `tfscale.collectives.powersgd`. Its state is saved per worker by
            `tfscale.checkpoint` (and so by tfscale's backup callbacks).
        timeout_seconds: a collective that has not completed after this many
            seconds fails, so a lost worker stops its peers instead of leaving
            them waiting forever (one watchdog thread per worker keeps it,
            `tfscale.collectives.watchdog`). It must exceed the longest time one worker
            can legitimately run ahead of the others (the chief writing a
            checkpoint or an export, a slow first step while graphs are
            built). It also bounds each variable's creation under the
            strategy's scope, which waits for the chief's initial value
            (`tfscale.variable_creation`). `None` waits forever, as stock
            MWMS does.
        cost_model: a `tfscale.collectives.cost_model.CostModel` for the
            hybrid threshold and for how many chunks the hierarchical
            algorithms pipeline; `None`: its `DEFAULT`. Fit one to your
            cluster with `cost_model.fit`.
        time_all_reduces: add each all-reduce's exposed time to
            `Strategy.exposed_communication_seconds` (two timestamps per
            all-reduce). `False` leaves the all-reduces untimed, so nothing
            waits for every input of a batch before its result is stamped.
            Steps compiled by XLA (`jit_compile=True`) are never timed: XLA
            has no kernel for `tf.timestamp`.
        powersgd: `compression="powersgd"` only: its `PowerSGDOptions`
            (rank, start step, minimum compression rate); `None`: their
            defaults under PowerSGD.
        implementation: what carries the collectives, in TensorFlow's names:
            `"auto"` (default): NCCL when the worker's device is a GPU, ring
            otherwise; `"ring"`: TensorFlow's ring over gRPC everywhere;
            `"nccl"`: NCCL (`communication_hint="nccl"`) under every stage,
            refused here when TensorFlow sees no GPU. Through NCCL every
            collective of a worker is chained in one order that all workers
            share (NCCL communicators of a GPU share one stream: collectives
            of different groups launched in different orders can deadlock);
            broadcasts become all-reduces to which only the sender
            contributes (broadcasts take no ordering token); "bfloat16"
            compression travels as "float16" with its per-buffer scale (NCCL
            has no bfloat16); hierarchical and 2d buckets go whole, not in
            chunks. `Strategy.communication_implementation` says what was
            chosen. See `tfscale.collectives.implementation`. The NCCL path
            has been traced and checked on CPU, not run on a GPU by tfscale's
            tests; `tfscale-bench gpucheck` checks it on your GPUs.
        timeline: `None`, or a directory where each worker writes
            `worker-I.json` at exit: its last steps as a Chrome / Perfetto
            trace (the step, forward+backward, each bucket's stages and
            collectives, the optimizer update; `tfscale.timeline`, which
            also merges the workers' files). Needs `timeout_seconds` (the
            flight recorder's watchdog stamps the collectives). Costs two
            timestamps and a small variable write per span; for the whole
            process, `tf.timestamp` in a `tf.function` is then no longer
            ordered after the stateful ops traced before it
            (`tfscale._private.graph_order`), so `time_all_reduces`' exposed
            communication (and `StragglerReport`'s compute times) add up
            all-reduces that overlap: not comparable with a run without it.
        autotune_dir: `algorithm="auto"` (or `None`, whose default it is
            over TensorFlow's ring) only: a directory (the job's model
            directory) where the chief writes `autotune.json`, each
            all-reduce's choice; a job started again with it finds its
            choice there and tries nothing. Unused where nothing is tuned
            (one node; NCCL, whose default is the ring). `None`: choices are
            not kept.
    """

    algorithm: str | None = None
    fusion_threshold_bytes: int = 32 * _MiB
    hybrid_threshold_bytes: int | None = None
    local_size: int | None = None
    compression: str | None = None
    timeout_seconds: float | None = 300
    cost_model: cost_model_lib.CostModel | None = None
    time_all_reduces: bool = True
    powersgd: PowerSGDOptions | None = None
    implementation: str = "auto"
    timeline: str | None = None
    autotune_dir: str | None = None

    # (field, allowed values, whether None is allowed) of each choice.
    _CHOICES = (
        ("implementation", implementation_lib.IMPLEMENTATIONS, False),
        ("algorithm", ALGORITHMS, True),  # None: the implementation's default
    )
    # (field, rule, check, what None means or None) of each number.
    _NUMBERS = (
        ("fusion_threshold_bytes", "an integer >= 0", _integer(0), None),
        ("hybrid_threshold_bytes", "an integer >= 0", _integer(0),
         "to take it from the cost model"),
        ("local_size", "an integer >= 1 (workers per node)", _integer(1),
         "to group workers by host"),
        ("timeout_seconds", "a number > 0", _number(0, strict=True),
         "to wait forever"),
    )
    # (field, type, how the message names it) of each typed argument.
    _TYPES = (
        ("cost_model", cost_model_lib.CostModel,
         "a `tfscale.collectives.cost_model.CostModel` or None"),
        ("powersgd", PowerSGDOptions,
         "a `tfscale.collectives.options.PowerSGDOptions` or None"),
    )

    def __post_init__(self):
        for name, allowed, optional in self._CHOICES:
            value = getattr(self, name)
            if value not in allowed and not (optional and value is None):
                choices = f"None or one of {list(allowed)}" if optional else (
                    f"one of {list(allowed)}")
                raise ValueError(f"Argument `{name}` must be {choices}. "
                                 f"Received: {name}={value!r}")
        implementation_lib.check_implementation(
            self.implementation,
            num_gpus=(len(tf.config.list_physical_devices("GPU"))
                      if self.implementation == "nccl" else None))
        for name, rule, ok, none_means in self._NUMBERS:
            _check(name, getattr(self, name), rule, ok, none_means)
        if self.hybrid_threshold_bytes is not None and self.algorithm not in (None, "hybrid"):
            raise ValueError(
                "Argument `hybrid_threshold_bytes` only applies to "
                f"algorithm='hybrid'; this is algorithm={self.algorithm!r}. "
                f"Received: hybrid_threshold_bytes={self.hybrid_threshold_bytes!r}")
        if self.compression is not None and self.compression not in COMPRESSION_CHOICES:
            raise ValueError(
                "Argument `compression` must be None or one of "
                f"{list(COMPRESSION_CHOICES)}. Received: compression={self.compression!r}")
        for name, cls, described in self._TYPES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"Argument `{name}` must be {described}. "
                                f"Received: {name}={value!r}")
        if not isinstance(self.time_all_reduces, bool):
            raise TypeError(
                "Argument `time_all_reduces` must be True or False. "
                f"Received: time_all_reduces={self.time_all_reduces!r}")
        if self.compression == powersgd_lib.NAME:
            if self.powersgd is None:
                object.__setattr__(self, "powersgd", PowerSGDOptions())
        elif self.powersgd is not None:
            raise ValueError(
                "Argument `powersgd` only applies to compression='powersgd'; "
                f"this is compression={self.compression!r}. "
                f"Received: powersgd={self.powersgd!r}")
        if self.timeout_seconds is not None:
            object.__setattr__(self, "timeout_seconds", float(self.timeout_seconds))
        if self.timeline is not None:
            if not isinstance(self.timeline, (str, os.PathLike)) or not str(self.timeline):
                raise TypeError(
                    "Argument `timeline` must be None or a directory path. "
                    f"Received: timeline={self.timeline!r}")
            if self.timeout_seconds is None:
                raise ValueError(
                    "Argument `timeline` needs the flight recorder, which runs with "
                    "`timeout_seconds` set; give both. Received: timeline="
                    f"{self.timeline!r}, timeout_seconds=None")
            object.__setattr__(self, "timeline", os.fspath(self.timeline))
        if self.algorithm == autotune_lib.NAME and self.implementation == "nccl":
            raise ValueError(f"{autotune_lib.NCCL_REFUSAL} Received: algorithm='auto', "
                             "implementation='nccl'")
        if self.autotune_dir is not None:
            if not self.may_autotune:
                raise ValueError(
                    "Argument `autotune_dir` only applies to algorithm='auto' (the "
                    "default, algorithm=None, without hybrid_threshold_bytes and not "
                    f"over NCCL); this is algorithm={self.algorithm!r}, "
                    f"hybrid_threshold_bytes={self.hybrid_threshold_bytes!r}, "
                    f"implementation={self.implementation!r}. Received: autotune_dir="
                    f"{self.autotune_dir!r}")
            if not isinstance(self.autotune_dir, (str, os.PathLike)) or not str(
                    self.autotune_dir):
                raise TypeError(
                    "Argument `autotune_dir` must be None or a directory path. "
                    f"Received: autotune_dir={self.autotune_dir!r}")
            object.__setattr__(self, "autotune_dir", os.fspath(self.autotune_dir))

    def algorithm_on(self, implementation):
        """The algorithm that runs over `implementation` (resolved: "ring" or
        "nccl"): `algorithm`, or its default there
        (`implementation.default_algorithm`)."""
        return self.algorithm or implementation_lib.default_algorithm(
            implementation, self.hybrid_threshold_bytes)

    @property
    def may_autotune(self):
        """Whether the algorithm is "auto", given or as the default: where
        `autotune_dir` applies (`implementation="auto"` may still resolve to
        NCCL on a GPU, whose default is the ring)."""
        return self.algorithm_on(
            "nccl" if self.implementation == "nccl" else "ring") == autotune_lib.NAME

    def get_config(self):
        config = {field.name: getattr(self, field.name)
                  for field in dataclasses.fields(self)}
        for name in ("cost_model", "powersgd"):
            if config[name] is not None:
                config[name] = config[name].get_config()
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.get("cost_model") is not None:
            config["cost_model"] = cost_model_lib.CostModel.from_config(config["cost_model"])
        if config.get("powersgd") is not None:
            config["powersgd"] = PowerSGDOptions.from_config(config["powersgd"])
        return cls(**config)
