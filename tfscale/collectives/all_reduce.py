"""`AllReduce`: runs the plan of each list of tensors on this worker's groups."""


import contextlib
import dataclasses
import functools

from absl import logging
import tensorflow as tf

from tfscale._private import accessors
from tfscale._private import graph_order
from tfscale._private import tf_collectives
from tfscale.collectives import algorithms
from tfscale.collectives import autotune as autotune_lib
from tfscale.collectives import compression as compression_lib
from tfscale.collectives import cost_model as cost_model_lib
from tfscale.collectives import fusion
from tfscale.collectives import implementation as implementation_lib
from tfscale.collectives import timeline_stamps
from tfscale.collectives import topology as topology_lib
from tfscale.collectives.plan import ALGORITHMS
from tfscale.collectives.plan import auto_plan
from tfscale.collectives.plan import check_supported
from tfscale.collectives.plan import describe_plan
from tfscale.collectives.plan import plan


def timed_all_reduce(reduce_fn, tensors, exposed_communication_seconds):
    """`reduce_fn(tensors)`, adding its exposed communication time to a variable.

    Adds to `exposed_communication_seconds` (a float64 `tf.Variable`) the
    seconds from the moment the last of `tensors` is ready to the moment the
    last result is: the part of the all-reduce not overlapped with computing
    its inputs.

    Inside a step compiled by XLA (`jit_compile=True`) nothing is added: XLA
    has no kernel for `tf.timestamp`.

    Returns:
        What `reduce_fn` returns (tensors, or a nest of them).
    """
    if accessors.in_xla_context():
        return reduce_fn(tensors)
    with tf.control_dependencies(tf.nest.flatten(tensors)):
        inputs_ready = tf.timestamp()
    reduced = reduce_fn(tensors)
    with tf.control_dependencies(tf.nest.flatten(reduced)):
        # A stateful op: tf.function runs it although nothing consumes it.
        exposed_communication_seconds.assign_add(tf.timestamp() - inputs_ready)
    return reduced


def make_groups(world, topology):
    """This worker's `algorithms.Groups`, sub-groups created from `world`.

    Creating a group issues no collective: groups no algorithm uses cost
    nothing but a handle.

    Args:
        world: `CollectiveGroup` (tfscale._private.tf_collectives) of all workers.
        topology: a `topology.Topology`.
    """
    groups = {
        kind: world.subgroup(index, size)
        for kind, (index, size) in topology_lib.subgroup_indices(topology).items()
    }
    pairs = {}
    if topology_lib.halving_doubling_fits(topology):
        pairs = {
            partner: world.subgroup(index, 2)
            for partner, index in topology_lib.pair_subgroup_indices(topology).items()
        }
    return algorithms.Groups(
        world=world,
        intra_in=groups.get("intra_in"),
        intra_out=groups.get("intra_out"),
        cross=groups.get("cross"),
        local_rank=topology.local_rank,
        local_size=topology.local_size,
        rank=topology.rank,
        pairs=pairs,
    )


def fused_all_reduce(tensors, groups, buckets, compression=None, note=None,
                     tuning_call=None, lane_suffix=""):
    """Sums `tensors` over all workers following a plan.

    Args:
        tensors: dense tensors, in the order given to `plan`.
        groups: this worker's `algorithms.Groups`.
        buckets: `plan(...)` for these tensors.
        compression: as given to `plan` (applied where a bucket's
            `wire_dtype` says so).
        note: `None`, or `fn(**fields)` returning a context manager inside
            which each bucket's collectives are traced, told the bucket's
            number, the bucket count, its algorithm and the `indices` of its
            tensors in the order given (`FlightRecorder.context`); and, as
            spans of the timeline, the bucket and each of its stages.
        tuning_call: for buckets of algorithm "auto": the `autotune.Call`
            that runs one of their candidates.
        lane_suffix: ends each bucket's timeline lane (the plans of auto's
            fusion thresholds keep apart).

    Returns:
        The summed tensors, in the order given.
    """
    num_workers = groups.world.size

    def span(name, after, **fields):  # a span of the timeline, if it is on
        return note(span=name, after=after, **fields) if note else contextlib.nullcontext()

    results = [None] * len(tensors)
    previous = []  # the last "auto" bucket's result: the next one starts after it
    for number, bucket in enumerate(buckets):
        inputs = [tensors[i] for i in bucket.indices]
        compressing = compression if bucket.wire_dtype != bucket.dtype else None
        with span(f"bucket {number}", inputs, lane=f"bucket {number}{lane_suffix}",
                  bucket=number,
                  buckets=len(buckets), algorithm=bucket.algorithm,
                  indices=list(bucket.indices)):
            if bucket.algorithm == autotune_lib.NAME:
                # Each candidate fuses, reduces and unpacks in its own branch
                # (the timeline's stage spans cannot cross into a branch).
                with span(bucket.algorithm, inputs):
                    pieces = previous = tuning_call.run(number, inputs, {
                        algorithm: functools.partial(
                            _reduce_bucket, inputs, algorithm, num_chunks, groups,
                            compressing, num_workers, note=note)
                        for algorithm, num_chunks in bucket.candidates}, after=previous)
            else:
                pieces = _reduce_bucket(inputs, bucket.algorithm, bucket.num_chunks,
                                        groups, compressing, num_workers, span=span)
        for i, tensor in zip(bucket.indices, pieces):
            results[i] = tensor
    return results


def _reduce_bucket(inputs, algorithm, num_chunks, groups, compressing, num_workers,
                   span=None, note=None):
    """The sums of one bucket's `inputs`: fused, compressed (`compressing`),
    all-reduced by `algorithm`, unpacked. `span`: the timeline's stage
    spans; `note` (an "auto" candidate): its collectives described as
    `algorithm`'s."""
    def stage(name, after):
        return span(name, after) if span else contextlib.nullcontext()

    def max_all_reduce(value):
        return groups.world.all_reduce(value, merge_op="Max")

    with stage("fuse", inputs):
        buffer, shapes = fusion.pack(inputs)
    with stage("compress", buffer) if compressing else contextlib.nullcontext():
        wire, context = compression_lib.compress(
            buffer, compressing, num_workers, max_all_reduce)
    with stage(algorithm, wire), (note(algorithm=algorithm) if note
                                  else contextlib.nullcontext()):
        reduced = algorithms.BUFFER_ALGORITHMS[algorithm](wire, groups, num_chunks)
    with stage("decompress", reduced) if compressing else contextlib.nullcontext():
        reduced = compression_lib.decompress(reduced, context)
    with stage("unpack", reduced):
        return fusion.unpack(reduced, shapes)


class AllReduce:
    """What `tfscale.Strategy` hands its cross-device ops: `fn(tensors, world)`.

    Fuses tensors in backward order (last layer first: backprop produces those
    first, so their buckets can be reduced while earlier layers are still
    being differentiated), plans each bucket, and runs the plan. The plan of
    each distinct list of tensors is logged once, where `log_plans` is set
    (the chief).

    Args:
        topology: a `topology.Topology`.
        algorithm: one of `ALGORITHMS`.
        fusion_threshold_bytes: bucket size, see `fusion.bucket_indices`.
        hybrid_threshold_bytes: see `plan`.
        compression: see `plan`.
        cost_model: see `plan`.
        log_plans: whether to log each new plan (set it on the chief only).
        exposed_communication_seconds: `None`, or a float64 `tf.Variable` to
            which each call adds its exposed communication time (see
            `timed_all_reduce`).
            Buckets reduced while backprop still runs are hidden from it;
            waiting for a slower worker is not.
        implementation: `"ring"` or `"nccl"`, resolved on the worker's device
            (`implementation.resolve`); the groups given to `__call__` must
            have been made with it. On `"nccl"`, "bfloat16" compression
            travels as "float16" (NCCL has no bfloat16) and every bucket goes
            whole (`num_chunks=1`): chunks on one ordering chain cannot
            overlap. See `tfscale.collectives.implementation`.
        note: `None`, or `fn(**fields)` describing each bucket's collectives
            (see `fused_all_reduce`; `indices` in the order given to
            `__call__`).
        autotuner: algorithm="auto" only: the `autotune.AutoTuner` keeping
            its trials and choices; `None`: one of its own (no directory).
    """

    def __init__(
        self, topology, algorithm, fusion_threshold_bytes,
        hybrid_threshold_bytes=None, compression=None, cost_model=None,
        log_plans=False, exposed_communication_seconds=None,
        implementation="ring", note=None, autotuner=None,
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"Argument `algorithm` must be one of {list(ALGORITHMS)}. "
                f"Received: algorithm={algorithm!r}"
            )
        check_supported(topology, algorithm)
        tf_collectives.check_resolved(implementation)
        if algorithm == autotune_lib.NAME and implementation == "nccl":
            raise NotImplementedError(autotune_lib.NCCL_REFUSAL)
        if algorithm == autotune_lib.NAME and autotuner is None:
            autotuner = autotune_lib.AutoTuner()
        self.autotuner = autotuner
        self.topology = topology
        self.algorithm = algorithm
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.hybrid_threshold_bytes = hybrid_threshold_bytes
        self.implementation = implementation
        self.compression = implementation_lib.wire_compression(compression, implementation)
        if log_plans and self.compression != compression:
            logging.info("tfscale: NCCL has no bfloat16; compression='%s' "
                         "travels as '%s' (scaled per buffer).",
                         compression, self.compression)
        self.cost_model = cost_model or cost_model_lib.DEFAULT
        self.log_plans = log_plans
        self.exposed_communication_seconds = exposed_communication_seconds
        self.note = note
        self._groups = {}
        self._logged = set()

    def plan(self, tensors, fusion_threshold_bytes=None, order=None):
        """The buckets for `tensors` (given in forward order), fused at
        `fusion_threshold_bytes` (None: the given one); "auto": its
        candidates in `order` (None: the cost model's)."""
        backward = list(reversed(tensors))
        sizes, dtypes = [fusion.size_bytes(t) for t in backward], [t.dtype for t in backward]
        if fusion_threshold_bytes is None:
            fusion_threshold_bytes = self.fusion_threshold_bytes
        if self.algorithm == autotune_lib.NAME:
            return auto_plan(sizes, dtypes, self.topology, fusion_threshold_bytes,
                             self.compression, self.cost_model, order=order)
        buckets = plan(
            sizes, dtypes,
            self.topology, self.algorithm, fusion_threshold_bytes,
            self.hybrid_threshold_bytes, self.compression, self.cost_model,
        )
        if self.implementation == "nccl":
            buckets = [dataclasses.replace(b, num_chunks=1) for b in buckets]
        return buckets

    def groups(self, world):
        """This worker's groups under `world`, created once."""
        if world.implementation != self.implementation:
            raise ValueError(
                f"This AllReduce runs implementation={self.implementation!r} "
                f"but its group was made for {world.implementation!r}.")
        if id(world) not in self._groups:
            if self.algorithm == "ring" or (
                self.topology.is_flat and self.algorithm in ("hierarchical", "2d", "auto")
            ):
                groups = algorithms.Groups(world=world)  # no sub-groups needed
            else:
                groups = make_groups(world, self.topology)
            # Holding `world` keeps its id from being reused.
            self._groups[id(world)] = (world, groups)
        return self._groups[id(world)][1]

    def threshold_plans(self, tensors, buckets=None):
        """"auto": `(thresholds, plans)`, the plan of `tensors` at each
        fusion threshold `autotune` tries that cuts them differently, the
        given threshold's (`buckets`, if planned) first, its candidates'
        order shared by all. One plan where nothing is tried or a size is
        known only at run time."""
        buckets = buckets or self.plan(tensors)
        if not any(b.candidates for b in buckets) or not all(b.candidates for b in buckets):
            return (self.fusion_threshold_bytes,), [buckets]
        order = [a for a, _ in buckets[0].candidates]
        thresholds, plans = [self.fusion_threshold_bytes], [buckets]
        cuts = {tuple(b.indices for b in buckets)}
        for threshold in autotune_lib.fusion_thresholds(self.fusion_threshold_bytes)[1:]:
            plan_ = self.plan(tensors, threshold, order)
            cut = tuple(b.indices for b in plan_)
            if cut not in cuts:
                cuts.add(cut)
                thresholds.append(threshold)
                plans.append(plan_)
        return tuple(thresholds), plans

    def __call__(self, tensors, world):
        """Sums `tensors` (dense, forward order) over all workers."""
        backward = list(reversed(tensors))
        buckets = self.plan(tensors)
        plans = [buckets]
        tuning, untried, chosen = None, False, None
        if any(b.candidates for b in buckets):
            # No trials inside XLA (no tf.timestamp), nor under op
            # determinism (a choice by timings would differ between runs).
            untried = accessors.in_xla_context() or accessors.op_determinism_enabled()
            if not untried:
                thresholds, plans = self.threshold_plans(tensors, buckets)
                every = [b for p in plans for b in p]
                tuning = self.autotuner.tuned_plan(
                    self.autotuner.call_site(
                        autotune_lib.plan_key(self.topology, every, thresholds)),
                    tuple(a for a, _ in next(b for b in buckets if b.candidates).candidates),
                    [None if b.candidates else b.algorithm for b in every],
                    thresholds, [t for t, p in enumerate(plans) for _ in p])
                untried = tuning is None  # beyond what the tuner holds
                if tuning is not None and self.autotuner.decided(tuning):
                    # Traced again after the choice: a fixed plan, as fast
                    # as one (the cases' branches return only once their
                    # whole branch has run, so cases cannot pipeline).
                    threshold, buckets = self.autotuner.chosen_buckets(tuning, plans)
                    tuning.retraced = True
                    chosen = (tuning, threshold)
                    tuning, plans = None, [buckets]
            if untried:
                buckets = [self._prior_choice(b) for b in buckets]
                plans = [buckets]
        self._log(buckets, tuning, untried, plans, chosen)
        last = len(tensors) - 1

        def note(indices=None, **fields):  # indices in the order given to us
            if indices is not None:
                fields["indices"] = [last - i for i in indices]
            return self.note(**fields)

        def reduce_fn(backward):
            groups = self.groups(world)
            call = tuning and self.autotuner.begin(tuning, groups.world)
            if tuning is None or not tuning.times_spans:
                return fused_all_reduce(
                    backward, groups, buckets, self.compression,
                    note=note if self.note else None, tuning_call=call)
            # Several thresholds: each plan traced, a step runs one; the
            # call timed whole (one plan alike, to weigh its buckets' mix).
            first_ready = graph_order.unordered(
                timeline_stamps.TimelineStamps.stamp([backward[0]]))
            return call.select(first_ready, [
                fused_all_reduce(backward, groups, plan_, self.compression,
                                 note=note if self.note else None,
                                 tuning_call=call.for_threshold(number),
                                 lane_suffix=f" at {threshold:,} bytes")
                for number, (threshold, plan_) in enumerate(zip(tuning.thresholds, plans))])

        if self.exposed_communication_seconds is None:
            return list(reversed(reduce_fn(backward)))
        return list(reversed(
            timed_all_reduce(reduce_fn, backward, self.exposed_communication_seconds)
        ))

    def _prior_choice(self, bucket):
        """An "auto" bucket as the candidate the cost model predicts fastest."""
        if not bucket.candidates:
            return bucket
        algorithm, num_chunks = min(bucket.candidates, key=lambda c: self.cost_model.predict(
            c[0], bucket.wire_bytes, self.topology.node_sizes, c[1]))
        return dataclasses.replace(bucket, algorithm=algorithm, num_chunks=num_chunks,
                                   candidates=())

    def _log(self, buckets, tuning=None, untried=False, plans=(), chosen=None):
        """Logs the plan of `buckets` once (the chief); `chosen`: `(tuned
        plan, threshold index)` where auto traces its choice as a fixed plan."""
        key = tuple((b.indices, b.size_bytes, b.dtype, b.algorithm) for b in buckets)
        if not self.log_plans or key in self._logged:
            return
        self._logged.add(key)
        threshold = ""
        if chosen is not None:
            tuned, number = chosen
            made = ("the stored choice" if tuned.stored is not None else
                    f"the choice made after {tuned.trial_steps} trial steps")
            threshold = f", auto: {made}, traced again as a fixed plan"
            if len(tuned.thresholds) > 1:
                threshold += f" at fusion threshold {tuned.thresholds[number]:,} bytes"
        elif self.algorithm == "hybrid" and self.hybrid_threshold_bytes is None:
            threshold = ", hybrid: each bucket by the cost model's fastest prediction"
        elif self.algorithm == "hybrid":
            threshold = (f", hybrid threshold {self.hybrid_threshold_bytes:,} bytes "
                         "(given)")
        elif tuning is not None and tuning.stored is not None:
            threshold = ", auto: the choice stored in " + str(self.autotuner.path())
            if len(plans) > 1:
                threshold += (f", fusion threshold "
                              f"{tuning.thresholds[tuning.stored_threshold]:,} bytes")
        elif tuning is not None and len(plans) > 1:
            threshold = (
                ", auto: the plans at fusion thresholds " + " and ".join(
                    f"{t:,} bytes ({len(p)} bucket(s))" for t, p in zip(tuning.thresholds, plans))
                + f" take turns for the first {tuning.trial_steps} calls, each bucket "
                f"trying {', '.join(tuning.candidates)} in turn (1 warm-up + "
                f"{autotune_lib.ROUNDS} timed each){self._mix_text(tuning)}; then the "
                "call keeps the threshold and the configuration with the least span; "
                "the plan at the given threshold")
        elif tuning is not None:
            threshold = (f", auto: each bucket tries {', '.join(tuning.candidates)} in "
                         f"turn for its first {tuning.trial_steps} calls (1 warm-up + "
                         f"{autotune_lib.ROUNDS} timed each){self._mix_text(tuning)}, "
                         "then keeps " + ("the one with the least span" if tuning.mixes
                                          else "its fastest"))
        elif self.algorithm == autotune_lib.NAME and untried:
            threshold = (", auto: the cost model's choice, no trials (inside XLA, "
                         "under op determinism, or beyond the tuner's limits)")
        elif self.algorithm == autotune_lib.NAME:
            threshold = (", auto: nothing to choose (one node, one worker per node, "
                         "or sizes known only at run time)")
        listed = (buckets if tuning is None or tuning.stored is None
                  else self._stored_choices(plans, tuning))
        logging.info(
            "tfscale all-reduce of %d tensor(s) on %s: algorithm=%s, "
            "fusion_threshold_bytes=%s, compression=%s%s%s; %d bucket(s), "
            "last layers first:\n%s",
            sum(len(b.indices) for b in buckets), self.topology.describe(),
            self.algorithm, f"{self.fusion_threshold_bytes:,}", self.compression,
            threshold, ", through NCCL" if self.implementation == "nccl" else "",
            len(listed), describe_plan(listed),
        )

    @staticmethod
    def _mix_text(tuning):
        """How a plan whose buckets can mix candidates weighs the mix."""
        if not tuning.mixes:
            return ""
        return (f", then {autotune_lib.ROUNDS} timed with each bucket its fastest "
                "(against one candidate for all)")

    @staticmethod
    def _stored_choices(plans, tuning):
        """The buckets of the stored threshold's plan as the stored choice of
        `tuning` makes them."""
        return autotune_lib.fixed_buckets(
            plans[tuning.stored_threshold], tuning.candidates,
            [tuning.stored[r] for r in tuning.buckets_of(tuning.stored_threshold)])
