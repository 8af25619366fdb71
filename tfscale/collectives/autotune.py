"""`algorithm="auto"`: each bucket's all-reduce algorithm chosen by measuring it.

The cost model predicts from a few link constants; a cluster's real costs
(the fixed cost of each TensorFlow collective op, CPU contention, the
switch) are what the job itself measures. As Horovod's autotuner does
(horovod/common/parameter_manager.cc: it scores fusion settings by the
bytes all-reduced per second of the running job), tfscale measures the
running job: during its first steps each gradient bucket runs every
candidate algorithm in turn on its real data, and keeps the fastest.

- Fusion thresholds (`fusion_thresholds`): the plan at the given
  `fusion_threshold_bytes` and at a quarter of it (8 and 32 MiB by
  default), where they cut the gradients differently. Smaller buffers
  start sooner during backprop and cost more ops; which wins depends on
  the model and the cluster (`tfscale-bench train
  --fusion_thresholds=8388608,33554432` compares them); Horovod's
  autotuner tunes its fusion threshold alike (docs/autotune.rst).
- Candidates (`candidates`): the algorithms that differ on the topology,
  among ring, hierarchical and 2d (halving-doubling is left out: each of
  its steps is a TensorFlow op of its own, the slowest on that runtime;
  BENCHMARKS.md, section "The fixed cost of one collective"). One node,
  or one worker per node: only the ring, and nothing to try. The cost
  model orders them (its fastest prediction for the plan first) and
  breaks ties.
- Trials: with K thresholds and C candidates, step s < K * C * (ROUNDS + 1)
  of a call runs the plan of threshold s mod K, every bucket of it with
  candidate (s // K) mod C (the other thresholds' buckets skip); each
  threshold's first round warms up (a group's first collective resolves
  it). In the other rounds each bucket's time from its case's start
  (after its tensors and the bucket before it) to its result is kept per
  candidate and round, and so is the call's span,
  from its first gradient ready to its last result, per threshold,
  candidate and round: what a threshold changes is how much of the
  all-reduce backprop hides, which no single bucket shows. All buckets run
  the same candidate in a step, so each bucket is timed beside the same
  traffic.
- Each bucket's fastest, in the first step after those trials, on every
  worker at once: one all-reduce takes each (bucket, candidate, round)
  time's minimum over the workers, and each bucket takes the candidate
  with the least sum over the rounds (the first in the cost model's order
  on a tie). In one round the minimum is about the worker whose tensors
  were ready last: no algorithm can start before it, so its time is mostly
  the algorithm's own, where an earlier worker's also counts its wait for
  the others (the skew between workers, which differs from step to step
  and, where workers share cores, can make a small bucket's candidate
  look several times slower under the maximum).
  Per round, because the last worker differs between rounds. Where workers
  play different roles the minimum favours the light ones: a worker alone
  in its node skips hierarchical's broadcast inside a node, so on unequal
  nodes hierarchical's time is low by about that broadcast.
- The mix measured: where a plan's buckets could take different candidates,
  that mix (each bucket its fastest) is a configuration no trial ran, and
  a bucket's time does not show how it overlaps backprop and the buckets
  around it, so the buckets' fastest together can be slower than one
  candidate for all. So the next K * ROUNDS
  steps run the mix at each threshold in turn, its span timed as the
  candidates' were.
- Decision, in the step after the mix's (after the trials where no bucket
  could differ from another), on every worker at once: the spans' least
  over the workers per round, summed over the rounds; the call keeps the
  threshold and the configuration (one candidate for all its buckets, or
  the mix) with the least (the given threshold, then the cost model's
  order, then the mix on a tie). Every worker computes it from the same
  all-reduced numbers, so every worker picks the same.
- The chief logs the choice and writes it to `DIR/autotune.json`
  (`directory`); a restarted job whose chief finds its plan there sends
  the stored choice to every worker in its first step and tries nothing.
- Inside XLA (`jit_compile=True`), which has no `tf.timestamp`, and under
  op determinism (`tf.config.experimental.enable_op_determinism()`, whose
  runs must repeat each other bit for bit, which a choice by timings would
  not): no trials, each bucket takes the cost model's fastest prediction.

During the trials the algorithm of a bucket is a `tf.switch_case` over
the candidates (and, with several thresholds, a branch that skips it): the
graph holds each candidate's fusion and collectives (every worker traces
the same branches, so their keys agree), a step runs one; each tensor's
result is then taken from the plan of the step's threshold. Each bucket's
case starts after the one before it has its result, in the plan's order,
as a fixed algorithm's collectives follow their group's ordering token
(without that order every ready bucket's collectives would run at once).
A bucket's time is its own case's, from its tensors and the previous
bucket's results ready (`_stamped`) to its result.

After the decision a function is traced again (`retrace_due`: Keras's
`fit` does it after the batch, tfscale/fit_hooks.py): each all-reduce whose
choice is made traces the chosen threshold's plan with each bucket's
choice as a fixed plan, the graph a user who named that configuration
would get. Cases cannot run it as fast: every output of a branch waits for
every stateful op of the branch (`tf.function`'s automatic control
dependencies make each branch's returns wait for all its collectives), so
one bucket's next stage never overlaps the previous bucket's last, as a
fixed plan's stages on different groups do. A custom training loop that
does not build its `tf.function` again keeps running the choice through
the cases, correctly.
"""

import dataclasses
import json
import os
import threading
import weakref

from absl import logging
import numpy as np
import tensorflow as tf

from tfscale import _atomic
from tfscale import communication_names
from tfscale._private import graph_order
from tfscale.collectives import timeline_stamps

NAME = communication_names.AUTO
# Timed rounds of trials, after one warm-up round.
ROUNDS = 2
FILE_NAME = "autotune.json"
# What one strategy can tune: buckets over all its plans, plans.
MAX_BUCKETS = 4096
MAX_PLANS = 1024
# Why "auto" is refused over NCCL, and what to use instead.
NCCL_REFUSAL = ("algorithm='auto' tries TensorFlow-ring algorithms; over NCCL use "
                "algorithm='ring' (NCCL picks its own ring or tree), or "
                "implementation='ring' to tune over TensorFlow's ring.")
# The algorithms "auto" chooses from, where the topology makes them differ.
CHOICES = ("ring", "hierarchical", "2d")
# The fusion thresholds it tries: the given one divided by each.
FUSION_DIVISORS = (1, 4)


def trial_steps(num_candidates, num_thresholds=1, mixes=False):
    """Steps a call with `num_candidates` candidates and `num_thresholds`
    fusion thresholds spends on its trials: each candidate's, then, where
    its buckets `mixes` candidates, the mix's."""
    mix = num_thresholds * ROUNDS if mixes else 0
    return num_thresholds * num_candidates * (ROUNDS + 1) + mix


# Steps before every plan has run its trials (at most all of CHOICES at
# each threshold, and the mix) and the step that decides: from this step
# index on, each runs its choice alone.
DECIDED_BY_STEP = trial_steps(len(CHOICES), len(FUSION_DIVISORS), mixes=True) + 1


def fusion_thresholds(given):
    """The fusion thresholds "auto" tries for `given` bytes, the given first
    (`AllReduce` drops those that cut the tensors as another does)."""
    return tuple(dict.fromkeys(given // d for d in FUSION_DIVISORS))


def candidates(topology, supported):
    """The algorithms worth trying on `topology`, unordered.

    Args:
        topology: a `topology.Topology`.
        supported: `fn(algorithm) -> bool`, whether it runs on `topology`.
    """
    if topology.is_flat:  # hierarchical and 2d run as a ring
        return ("ring",)
    return tuple(a for a in CHOICES if supported(a))


@dataclasses.dataclass
class TunedPlan:
    """The tuning state of one call site's plan on this worker."""

    key: str
    number: int  # its row in `AutoTuner.steps`
    offset: int  # its first row in `AutoTuner.seconds` and `chosen`
    candidates: tuple
    # Per bucket (of every threshold's plan, one after another): None where
    # it tries the candidates, else its one algorithm (a buffer whose size
    # is known only at run time goes by ring).
    fixed: tuple
    stored: list | None  # the chief's stored choice (indices), if any
    # The fusion thresholds tried (bytes; (None,): one plan, not tried) and
    # each bucket's threshold (its index in `thresholds`).
    thresholds: tuple = (None,)
    bucket_thresholds: tuple | None = None
    stored_threshold: int = 0  # with `stored`: the stored threshold's index
    retraced: bool = False  # traced with its choice as a fixed plan

    def __post_init__(self):
        if self.bucket_thresholds is None:
            self.bucket_thresholds = (0,) * len(self.fixed)

    @property
    def num_buckets(self):
        return len(self.fixed)

    @property
    def mixes(self):
        """Whether its buckets can take different candidates: several
        candidates, and a threshold's plan with two buckets trying them."""
        return len(self.candidates) > 1 and any(
            sum(self.fixed[b] is None for b in self.buckets_of(t)) > 1
            for t in range(len(self.thresholds)))

    @property
    def candidate_steps(self):
        """The steps of the candidates' trials, before the mix's."""
        return trial_steps(len(self.candidates), len(self.thresholds))

    @property
    def trial_steps(self):
        """All its trial steps: the candidates', then the mix's."""
        return trial_steps(len(self.candidates), len(self.thresholds), self.mixes)

    def decided_at(self, calls):
        """Whether its choice is made after `calls` calls (its step count)."""
        return calls > self.trial_steps

    @property
    def times_spans(self):
        """Whether its calls are timed whole: the spans choose between
        thresholds, or between the mix and one candidate for all."""
        return len(self.thresholds) > 1 or self.mixes

    def buckets_of(self, threshold):
        """The rows (relative to `offset`) of threshold number `threshold`."""
        return [b for b, t in enumerate(self.bucket_thresholds) if t == threshold]


class AutoTuner:
    """This worker's trials and choices, for every plan it all-reduces.

    Args:
        device: where its variables live (the worker's device).
        directory: `None`, or where the chief writes (and, on a restart,
            finds) `autotune.json`.
        is_chief: this worker logs and stores the choice.
    """

    def __init__(self, device=None, directory=None, is_chief=False):
        self.directory = None if directory is None else os.fspath(directory)
        self.is_chief = is_chief
        self.plans = {}
        self._buckets_used = 0
        self._calls = weakref.WeakKeyDictionary()  # traced function -> calls so far
        # Plan number -> its step count when `retrace_due` last looked, for
        # each plan a function traced with its trials (`begin`).
        self._tried = {}
        self._writing = threading.Lock()  # plans may decide in the same step
        with tf.device(device), tf.init_scope():
            # Seconds of each bucket's trial per candidate and timed round.
            self.seconds = tf.Variable(
                tf.zeros([MAX_BUCKETS, len(CHOICES), ROUNDS], tf.float32),
                trainable=False, name="autotune_seconds")
            # Each bucket's chosen candidate (its index in its plan's list).
            self.chosen = tf.Variable(tf.zeros([MAX_BUCKETS], tf.int32),
                                      trainable=False, name="autotune_chosen")
            # Calls of each plan so far.
            self.steps = tf.Variable(tf.zeros([MAX_PLANS], tf.int64),
                                     trainable=False, name="autotune_steps")
            # Each plan's chosen threshold (its index in the plan's list).
            self.threshold = tf.Variable(tf.zeros([MAX_PLANS], tf.int32),
                                         trainable=False, name="autotune_threshold")
            # Seconds of each plan's span per threshold, candidate (the
            # plan's C candidates, then, in column C, the mix) and round.
            self.span_seconds = tf.Variable(
                tf.zeros([MAX_PLANS, len(FUSION_DIVISORS), len(CHOICES) + 1, ROUNDS],
                         tf.float32), trainable=False, name="autotune_span_seconds")
        # The chief's stored choices by key; what it decides is added.
        self._stored = self._load() if is_chief else {}
        self._num_read = len(self._stored)  # read from the file, not decided here

    def path(self):
        return None if self.directory is None else os.path.join(self.directory, FILE_NAME)

    def _load(self):
        """The stored choices; a file that cannot be read is ignored with a
        warning (its plans are tried again), never a reason to stop."""
        path = self.path()
        if path is None or not os.path.exists(path):
            return {}
        try:
            with open(path) as f:
                stored = {plan["key"]: plan for plan in json.load(f)["plans"]}
        except (OSError, ValueError, KeyError, TypeError) as error:
            logging.warning("tfscale autotune: cannot read %s (%s: %s); every "
                            "all-reduce is tried again.", path, type(error).__name__, error)
            return {}
        logging.info("tfscale autotune: read %d stored choice(s) from %s; "
                     "plans found there are not tried again.", len(stored), path)
        return stored

    def call_site(self, buckets_key):
        """The key of this call: the traced functions it is made in (the
        outermost first), its place among the innermost one's all-reduces,
        and its buckets. Every worker traces the same functions alike, so it
        names the same call on each; two calls with equal buckets in one
        function keep apart (their step counts must not mix); a function
        traced again names its calls as before (the trace that finds a
        choice made, and TensorFlow's second trace of a function whose
        first created variables, as PowerSGD's state). Two functions of
        one name traced inside one outer function (one `tf.function`
        traced for two signatures) share their calls' names and step
        counts: their choice is then made on both calls' times, alike on
        every worker. Eager calls share one key per bucket list."""
        functions = _function_graphs()
        if not functions:
            return f"eager; {buckets_key}"
        ordinal = self._calls.get(functions[-1], 0)
        self._calls[functions[-1]] = ordinal + 1
        return f"{'/'.join(g.name for g in functions)} #{ordinal}; {buckets_key}"

    def tuned_plan(self, key, candidates, fixed, thresholds=(None,),
                   bucket_thresholds=None):
        """The `TunedPlan` of `key` (`call_site`), made on first use; None
        (with a warning: the call takes the cost model's choice) beyond
        `MAX_PLANS` calls or `MAX_BUCKETS` buckets.

        Args:
            key: the call's key.
            candidates: the algorithms tried, in the cost model's order.
            fixed: per bucket, None if it tries them, else its algorithm.
            thresholds: the fusion thresholds tried, the given one first.
            bucket_thresholds: each bucket's index in `thresholds`; None:
                all 0.
        """
        if key not in self.plans:
            if (len(self.plans) >= MAX_PLANS
                    or self._buckets_used + len(fixed) > MAX_BUCKETS):
                logging.warning(
                    "tfscale autotune: one strategy tunes at most %d all-reduce calls "
                    "and %d buckets; it has %d calls and %d buckets, so %s (%d "
                    "buckets) takes the cost model's choice without trials. A larger "
                    "fusion_threshold_bytes makes fewer buckets.", MAX_PLANS,
                    MAX_BUCKETS, len(self.plans), self._buckets_used,
                    key.split(";")[0], len(fixed))
                return None
            stored_threshold, stored = self._stored_choice(
                key, candidates, len(fixed), len(thresholds)) or (0, None)
            self.plans[key] = TunedPlan(
                key, len(self.plans), self._buckets_used, tuple(candidates), tuple(fixed),
                stored, tuple(thresholds),
                None if bucket_thresholds is None else tuple(bucket_thresholds),
                stored_threshold)
            self._buckets_used += len(fixed)
        return self.plans[key]

    def _stored_choice(self, key, candidates, num_buckets, num_thresholds):
        """The stored choice of `key` as `(threshold index, candidate
        indices)`, if it is one for these candidates and buckets; else None
        (tried again). The key names every threshold's buckets."""
        stored = self._stored.get(key)
        if stored is None:
            if self._num_read:  # said, so that a restart that tries again says why
                logging.info("tfscale autotune: none of the %d choices stored in %s "
                             "is for %s (they are other calls': other code's, or "
                             "another tfscale version's); it is tried.",
                             self._num_read, self.path(), key.split(";")[0])
            return None
        choices = stored.get("choices")
        threshold = stored.get("threshold_index", 0)
        if (list(stored.get("candidates", [])) != list(candidates) or not isinstance(
                choices, list) or len(choices) != num_buckets
                or any(a not in candidates for a in choices)
                or threshold not in range(num_thresholds)):
            logging.warning("tfscale autotune: the choice stored in %s for %s is for "
                            "other candidates or buckets; it is tried again.",
                            self.path(), key)
            return None
        return threshold, [candidates.index(a) for a in choices]

    def decided(self, plan):
        """Whether `plan`'s choice is made, read now (when tracing: by the
        steps run so far; every worker has run the same)."""
        with tf.init_scope():
            return plan.decided_at(self.steps[plan.number].numpy())

    def chosen_buckets(self, plan, plans):
        """`(threshold index, buckets)`: the chosen threshold's plan from
        `plans` (one per threshold), each bucket its chosen algorithm, read
        now."""
        with tf.init_scope():
            threshold = int(self.threshold[plan.number].numpy())
            chosen = self.chosen[plan.offset:plan.offset + plan.num_buckets].numpy()
        return threshold, fixed_buckets(plans[threshold], plan.candidates,
                                        [chosen[b] for b in plan.buckets_of(threshold)])

    def retrace_due(self):
        """Whether to build the traced functions anew now, so that each
        all-reduce whose choice is made runs it as a fixed plan would,
        without the trials' cases (module docstring). `fit` asks after each
        batch (tfscale/fit_hooks.py); a custom loop asks after each step and
        builds its `tf.function` again when it is True.

        True once per batch of choices: when a plan traced with its trials
        has chosen since the last True, and every such plan that ran since
        the last call has chosen too (one that still tries holds the others
        back, so a function is traced again once, not per all-reduce; one
        that stopped running, in a branch no longer taken, does not). It
        reads only the step counts, which every worker has alike at the same
        call: every worker sees True at the same step."""
        if not self._tried:
            return False
        steps = self.steps.numpy()
        plans = {plan.number: plan for plan in self.plans.values()}
        ran = [n for n, seen in self._tried.items() if steps[n] != seen]
        chosen = [n for n in self._tried if plans[n].decided_at(steps[n])]
        self._tried.update((n, steps[n]) for n in self._tried)
        if not chosen or not all(plans[n].decided_at(steps[n]) for n in ran):
            return False
        for n in chosen:
            del self._tried[n]
        return True

    def begin(self, plan, world):
        """Traces the start of one call of `plan`: the agreement on a stored
        choice (first step), each bucket's fastest (first step after the
        candidates' trials, where it mixes), the decision (first step after
        all trials); returns a `Call` whose `run` picks each bucket's
        algorithm (and `select` each tensor's threshold)."""
        if _function_graphs():  # eager calls need no retrace
            with tf.init_scope():
                self._tried.setdefault(plan.number, self.steps[plan.number].numpy())
        step = self.steps[plan.number]
        candidate_steps, trial_steps = plan.candidate_steps, plan.trial_steps
        rows = tf.range(plan.offset, plan.offset + plan.num_buckets)
        num_candidates, num_thresholds = len(plan.candidates), len(plan.thresholds)
        plan_threshold = self.threshold[plan.number]

        def read():
            return tf.gather(self.chosen, rows), plan_threshold, tf.constant(False)

        def agree_on_stored():
            # Only the chief reads the file (another host may not see it):
            # the others learn its choice, or that there is none, from it.
            mine = np.zeros([plan.num_buckets + 2], np.float32)
            if plan.stored is not None:
                mine[0], mine[1], mine[2:] = 1.0, plan.stored_threshold, plan.stored
            agreed = world.all_reduce(tf.constant(mine))
            stored = agreed[0] > 0.5
            choice = tf.where(stored, tf.cast(agreed[2:], tf.int32),
                              tf.gather(self.chosen, rows))
            threshold = tf.where(stored, tf.cast(agreed[1], tf.int32), plan_threshold)
            with tf.control_dependencies([self._set(rows, choice),
                                          self._set_threshold(plan, threshold)]):
                return tf.identity(choice), tf.identity(threshold), stored

        def least_over_workers():
            """Each bucket's (least over the workers, summed over the rounds)
            seconds per candidate, each (threshold, candidate and mix)'s
            span alike, and each bucket's fastest candidate."""
            buckets = tf.gather(self.seconds, rows)[:, :num_candidates]
            spans = self.span_seconds[plan.number, :num_thresholds, :num_candidates + 1]
            least = world.all_reduce(tf.concat(
                [tf.reshape(buckets, [-1]), tf.reshape(spans, [-1])], 0), merge_op="Min")
            split = plan.num_buckets * num_candidates * ROUNDS
            least_buckets = tf.reduce_sum(tf.reshape(
                least[:split], [plan.num_buckets, num_candidates, ROUNDS]), axis=2)
            least_spans = tf.reduce_sum(tf.reshape(
                least[split:], [num_thresholds, num_candidates + 1, ROUNDS]), axis=2)
            fastest = tf.argmin(least_buckets, axis=1, output_type=tf.int32)
            return least_buckets, least_spans, fastest

        def mix():
            _, _, fastest = least_over_workers()
            with tf.control_dependencies([self._set(rows, fastest)]):
                return tf.identity(fastest), plan_threshold, tf.constant(False)

        def decide():
            least_buckets, least_spans, fastest = least_over_workers()
            if plan.mixes:
                # The least span; on a tie the given threshold, then the
                # cost model's order, then the mix.
                best = tf.argmin(tf.reshape(least_spans, [-1]), output_type=tf.int32)
                threshold = best // (num_candidates + 1)
                configuration = best % (num_candidates + 1)
                choice = tf.where(configuration < num_candidates,
                                  tf.fill([plan.num_buckets], configuration), fastest)
            else:  # at most one bucket tries per threshold: its fastest
                threshold = tf.argmin(tf.reduce_min(least_spans[:, :num_candidates], axis=1),
                                      output_type=tf.int32)
                choice = fastest
            done = [self._set(rows, choice), self._set_threshold(plan, threshold)]
            if self.is_chief:
                done.append(tf.py_function(
                    lambda c, t, s, p, f: self.report(
                        plan, c.numpy(), s.numpy(), int(t.numpy()), p.numpy(),
                        f.numpy()) or 0,
                    [choice, threshold, least_buckets, least_spans, fastest], tf.int32))
            with tf.control_dependencies(done):
                return tf.identity(choice), tf.identity(threshold), tf.constant(False)

        # Unordered: ordered after the stateful ops traced before it (the
        # exposed-communication stamp waits for every gradient) it would hold
        # back every bucket. So is each bucket's Case (`Call.run`), chained
        # instead to the bucket before it.
        branches = [agree_on_stored, decide, read]
        branch = tf.where(tf.equal(step, 0), 0, tf.where(tf.equal(step, trial_steps), 1, 2))
        if plan.mixes:
            branches.append(mix)
            branch = tf.where(tf.equal(step, candidate_steps), 3, branch)
        chosen, chosen_threshold, stored = tf.switch_case(branch, branches)
        graph_order.unordered_case(chosen)
        trying = tf.logical_and(step < candidate_steps, tf.logical_not(stored))
        mixing = tf.logical_and(
            tf.logical_and(step >= candidate_steps, step < trial_steps), tf.logical_not(stored))
        # Each threshold's step: its first C warm up, then ROUNDS of C timed;
        # then, where it mixes, ROUNDS of the mix.
        own_step = step // num_thresholds
        timed = tf.logical_and(trying, own_step >= num_candidates)
        trial_round = tf.cast(tf.clip_by_value(own_step // num_candidates - 1, 0, ROUNDS - 1),
                              tf.int32)
        mix_round = tf.cast(tf.clip_by_value(
            (step - candidate_steps) // num_thresholds, 0, ROUNDS - 1), tf.int32)
        self.steps[plan.number].assign(
            tf.where(stored, tf.constant(trial_steps + 1, tf.int64), step + 1))
        candidate = tf.cast(own_step % num_candidates, tf.int32)
        threshold = tf.where(tf.logical_or(trying, mixing),
                             tf.cast(step % num_thresholds, tf.int32), chosen_threshold)
        choice = tf.where(trying, candidate, chosen)
        # A bucket of another threshold's plan skips (branch C).
        choice = tf.where(tf.equal(tf.constant(plan.bucket_thresholds, tf.int32), threshold),
                          choice, num_candidates)
        return Call(self, plan, choice, timed, trial_round, threshold,
                    span_timed=tf.logical_or(timed, mixing),
                    span_at=tf.where(mixing, tf.stack([num_candidates, mix_round]),
                                     tf.stack([candidate, trial_round])))

    def _set(self, rows, choice, variable=None):
        """The op writing `choice` to the rows of `variable` (`chosen`)."""
        return tf.raw_ops.ResourceScatterNdUpdate(
            ref=(self.chosen if variable is None else variable).handle,
            indices=rows[:, None], updates=choice)

    def _set_threshold(self, plan, threshold):
        """The op writing `plan`'s chosen threshold."""
        return self._set(tf.constant([plan.number]), threshold[None], self.threshold)

    def report(self, plan, choice, least, threshold=0, spans=None, fastest=None):
        """Logs the decision and stores it (the chief, once per plan). Runs
        inside the step: a file it cannot write is a warning, not a failure
        of the chief's step that would leave the others waiting.

        Args:
            choice: each bucket's candidate index.
            least: seconds per bucket and candidate, summed over the rounds.
            threshold: the chosen threshold's index.
            spans: seconds of the call per threshold and candidate (and, in
                a last column, the mix), summed over the rounds (where the
                plan times its calls whole).
            fastest: each bucket's fastest candidate (its index), if it is
                not `choice` (one candidate's span beat the mix's).
        """
        fastest = choice if fastest is None else fastest
        names = list(plan.candidates) + ["each bucket its fastest"] * plan.mixes

        def times(seconds, names=plan.candidates):  # mean milliseconds each
            return ", ".join(f"{a} {s / ROUNDS * 1e3:.1f} ms" for a, s in zip(names, seconds))

        lines = []
        if plan.times_spans:
            for t, (size, seconds) in enumerate(zip(plan.thresholds, spans)):
                at = (f"fusion threshold {size:,} bytes ({len(plan.buckets_of(t))} "
                      "bucket(s)), " if len(plan.thresholds) > 1 else "")
                lines.append(f"  {at}the call from its first gradient to its last "
                             f"result: {times(seconds, names)}"
                             + (" -> chosen" if t == threshold else ""))
        for number, bucket in enumerate(plan.buckets_of(threshold)):
            if plan.fixed[bucket] is not None:
                lines.append(f"  bucket {number}: {plan.fixed[bucket]} (its size is "
                             "known only at run time)")
                continue
            lines.append(f"  bucket {number}: {times(least[bucket])} -> "
                         f"{plan.candidates[fastest[bucket]]}")
        own = plan.buckets_of(threshold)
        if any(choice[b] != fastest[b] for b in own):  # this threshold's only
            lines.append(f"  every bucket takes {plan.candidates[choice[own[0]]]}: its "
                         "span was less than each bucket's fastest together")
        logging.info("tfscale autotune: %s: chose after %d trial steps (each bucket's "
                     "time from its tensors and the previous bucket's results ready "
                     "to its result, mean of %d steps, least over the workers in "
                     "each):\n%s", plan.key.split(";")[0],
                     plan.trial_steps, ROUNDS, "\n".join(lines))
        if self.directory is None:
            return
        with self._writing:
            self._stored[plan.key] = {
                "key": plan.key, "candidates": list(plan.candidates),
                "choices": self._names(plan, choice),
                "milliseconds": (np.asarray(least) / ROUNDS * 1e3).round(3).tolist()}
            if plan.times_spans:
                self._stored[plan.key].update(
                    threshold_index=threshold,
                    fusion_threshold_bytes=plan.thresholds[threshold],
                    span_milliseconds=(np.asarray(spans) / ROUNDS * 1e3).round(3).tolist())
            try:
                _atomic.write_json(self.path(), {"plans": list(self._stored.values())},
                                   indent=1)
            except OSError as error:
                logging.warning("tfscale autotune: cannot store the choice in %s (%s); "
                                "a restarted job will try again.", self.path(), error)

    @staticmethod
    def _names(plan, choice):
        """Each bucket's algorithm under `choice` (indices)."""
        return [fixed or plan.candidates[c] for fixed, c in zip(plan.fixed, choice)]

    def choices(self):
        """Each plan's state, read now: `{key: {"candidates", "steps",
        "choices" (algorithm per bucket of the chosen threshold, None until
        decided), "seconds" (this worker's, per bucket of the chosen
        threshold, candidate and timed round), "fusion_thresholds" (bytes
        tried, one where one plan), "fusion_threshold_bytes" (the chosen one),
        "span_seconds" (this worker's, per threshold, candidate and
        round), "mix_span_seconds" (this worker's, per threshold and round:
        each bucket its fastest; zeros where it does not mix), "retraced"
        (whether a function has been traced with the choice as a fixed
        plan)}}`. Before the decision the given threshold's buckets."""
        steps = self.steps.numpy()
        chosen = self.chosen.numpy()
        seconds = self.seconds.numpy()
        thresholds = self.threshold.numpy()
        spans = self.span_seconds.numpy()
        result = {}
        for key, plan in self.plans.items():
            decided = plan.decided_at(steps[plan.number])
            threshold = int(thresholds[plan.number]) if decided else 0
            own = plan.buckets_of(threshold)
            rows = [plan.offset + b for b in own]
            names = self._names(plan, chosen[plan.offset:plan.offset + plan.num_buckets])
            result[key] = {
                "candidates": list(plan.candidates), "steps": int(steps[plan.number]),
                "choices": [names[b] for b in own] if decided else None,
                "seconds": seconds[rows, :len(plan.candidates)].tolist(),
                "fusion_thresholds": list(plan.thresholds),
                "fusion_threshold_bytes": plan.thresholds[threshold] if decided else None,
                "span_seconds": spans[plan.number, :len(plan.thresholds),
                                      :len(plan.candidates)].tolist(),
                "mix_span_seconds": spans[plan.number, :len(plan.thresholds),
                                          len(plan.candidates)].tolist(),
                "retraced": plan.retraced}
        return result


@dataclasses.dataclass
class Call:
    """One traced call of a plan: runs each bucket's chosen algorithm, and
    takes each tensor from the chosen threshold's plan."""

    tuner: AutoTuner
    plan: TunedPlan
    choice: tf.Tensor  # per bucket, an index into plan.candidates (C: skip)
    timed: tf.Tensor  # whether this step's bucket times count
    trial_round: tf.Tensor  # which timed round it is, if so
    threshold: tf.Tensor  # the index of the threshold this step runs
    span_timed: tf.Tensor  # whether this step's span counts
    span_at: tf.Tensor  # if so, its column (candidate, or C: the mix) and round
    bucket_offset: int = 0  # the row (in the plan) of the plan's bucket 0

    def for_threshold(self, number):
        """This call for the buckets of threshold `number`'s plan."""
        return dataclasses.replace(self, bucket_offset=self.plan.buckets_of(number)[0])

    def run(self, bucket, inputs, branches, after=()):
        """The result of `branches[algorithm]()` for the algorithm bucket
        number `bucket` runs this step, started once `inputs` and `after`
        (the previous bucket's result) are ready and timed from then during
        the trials; with several thresholds, `inputs` as they are where its
        plan is not this step's.

        One bucket after the other, as a fixed algorithm's buckets run (the
        module's docstring says why)."""
        row = self.plan.offset + self.bucket_offset + bucket
        choice = self.choice[self.bucket_offset + bucket]
        cases = [branches[a] for a in self.plan.candidates]
        if len(self.plan.thresholds) > 1:
            cases.append(lambda: [tf.identity(t) for t in inputs])
        skipped = tf.equal(choice, len(self.plan.candidates))
        return _timed_case(
            choice, [_stamped(case, list(inputs) + list(after)) for case in cases],
            tf.logical_and(self.timed, tf.logical_not(skipped)),
            self.tuner.seconds, [row, tf.minimum(choice, len(self.plan.candidates) - 1),
                                 self.trial_round])

    def select(self, first_ready, results):
        """Each tensor from the plan of this step's threshold (`results`: one
        list per threshold), the call's span (from `first_ready`, a stamp)
        timed during the trials."""
        return _timed_case(
            self.threshold, [(lambda r=r: [first_ready] + list(r)) for r in results],
            self.span_timed, self.tuner.span_seconds,
            [self.plan.number, self.threshold, self.span_at[0], self.span_at[1]])


def _stamped(branch, ready):
    """`branch` returning, before its results, a stamp taken inside it once
    the tensors `ready` are, which every op it traces waits for.

    A stamp outside the case is one more ready op, which the executor ran
    after a 64-byte bucket's whole case (negative times). Inside, it waits
    for `ready` through identities, data inputs of the branch: a control
    dependency on a tensor from outside the branch becomes one of the
    `Case`'s own, and the case lowered to switches and inlined runs an op
    with no data inputs once the branch index (and the case's control
    inputs) are there, before its tensors are (measured: a stamp read times
    from about the step's start)."""
    def stamped():
        start = timeline_stamps.TimelineStamps.stamp([tf.identity(t) for t in ready])
        with tf.control_dependencies([start]):
            return [start] + list(branch())
    return stamped


def _timed_case(index, branches, timed, seconds, at):
    """The results of `tf.switch_case(index, branches)`, each branch
    returning a start stamp and then its results, run unordered (as in
    `AutoTuner.begin`: it waits for its inputs, not for the stateful ops
    traced before it); where `timed`, the seconds from the start stamp to
    the results are added to `seconds[at]`."""
    start, *result = tf.switch_case(index, branches)
    graph_order.unordered_case(start)
    end = graph_order.unordered(timeline_stamps.TimelineStamps.stamp(result))
    elapsed = tf.where(timed, tf.cast(end - start, tf.float32), 0.0)
    graph_order.unordered(tf.raw_ops.ResourceScatterNdAdd(
        ref=seconds.handle, indices=tf.stack(at)[None], updates=elapsed[None]))
    return result


def plan_key(topology, buckets, thresholds=(None,)):
    """What a stored choice is valid for: the topology and each bucket (of
    each threshold's plan, with several)."""
    return "; ".join([f"nodes {list(topology.node_sizes)}"] + [
        f"{len(b.indices)}x{b.size_bytes}:{b.dtype.name}>{b.wire_dtype.name}"
        for b in buckets] + ([f"fusion thresholds {list(thresholds)}"]
                             if len(thresholds) > 1 else []))


def fixed_buckets(buckets, candidates, choices):
    """`buckets` (one threshold's plan) with each "auto" bucket fixed to its
    choice (`choices`: an index into `candidates` per bucket)."""
    return [dataclasses.replace(b, algorithm=candidates[c], candidates=(),
                                num_chunks=dict(b.candidates)[candidates[c]])
            if b.candidates else b
            for b, c in zip(buckets, choices)]


def _function_graphs():
    """The `FuncGraph`s of the functions being traced, the outermost (the
    one a user or Keras calls) first, leaving out the branches and loop
    bodies of control flow; [] when eager."""
    graph, functions = tf.compat.v1.get_default_graph(), []
    while hasattr(graph, "outer_graph"):  # a FuncGraph
        if not getattr(graph, "is_control_flow_graph", False):
            functions.append(graph)
        graph = graph.outer_graph
    return functions[::-1]
