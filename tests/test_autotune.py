"""algorithm="auto" (tfscale.collectives.autotune): the candidates and plan
each worker computes, and Keras `fit` on 4 real workers in 2 nodes of 2:
trials, one choice on every worker, weights as the ring's, the choice
stored and reused by a restarted job."""

import json

import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.collectives import autotune
from tfscale.collectives import cost_model as cost_model_lib
from tfscale.collectives import topology as topology_lib
from tfscale.collectives.plan import auto_plan
from tfscale.collectives.plan import describe_plan
from tests import multiworker


def test_candidates_differ_only_where_the_topology_has_nodes():
    two_by_two = topology_lib.from_hosts(["a", "a", "b", "b"], 0, 2)
    buckets = auto_plan([4_000_000, 400], [tf.float32] * 2, two_by_two, 100_000)
    assert [b.algorithm for b in buckets] == ["auto", "auto"]
    assert {a for a, _ in buckets[0].candidates} == {"ring", "hierarchical", "2d"}
    assert "auto of " in describe_plan(buckets)
    # 3 workers in nodes of 2 and 1: 2d needs equal nodes.
    uneven = topology_lib.from_hosts(["a", "a", "b"], 0, 2)
    (bucket,) = auto_plan([4_000], [tf.float32], uneven, 0)
    assert {a for a, _ in bucket.candidates} == {"ring", "hierarchical"}
    # One node: every candidate is a ring, nothing to try.
    flat = topology_lib.from_hosts(["a"] * 4, 0, None)
    assert [b.algorithm for b in auto_plan([4_000, 40], [tf.float32] * 2, flat, 0)] == [
        "ring", "ring"]


def test_the_cost_model_orders_the_trials():
    topology = topology_lib.from_hosts(["a", "a", "b", "b"], 0, 2)
    model = cost_model_lib.DEFAULT

    def order(cost_model, size):
        (bucket,) = auto_plan([size], [tf.float32], topology, 0, cost_model=cost_model)
        return [a for a, _ in bucket.candidates]

    def predicted(cost_model, algorithm, size):
        return cost_model.predict(algorithm, size, topology.node_sizes)

    # Ops dominate: the ring (one op) first.
    slow_ops = cost_model_lib.CostModel(intra=model.intra, inter=model.inter,
                                        op_seconds=1.0)
    assert order(slow_ops, 400)[0] == "ring"
    # A slow link between nodes and free ops: 64 MiB crosses it less by
    # hierarchical or 2d, which come first, fastest prediction first.
    slow_link = cost_model_lib.CostModel(
        intra=model.intra, inter=cost_model_lib.Link(model.inter.alpha, 1 / 25e6),
        op_seconds=0.0)
    ordered = order(slow_link, 64 * 2**20)
    assert ordered[-1] == "ring"
    times = [predicted(slow_link, a, 64 * 2**20) for a in ordered]
    assert times == sorted(times)


def test_options_refuse_autotune_dir_without_auto_and_auto_over_nccl():
    with pytest.raises(ValueError, match="only applies to algorithm='auto'"):
        tfscale.CommunicationOptions(algorithm="ring", autotune_dir="/tmp/x")
    if not tf.config.list_physical_devices("GPU"):
        print("SKIPPED: auto over NCCL is refused where NCCL is allowed: no GPU here "
              "(implementation='nccl' is refused first)")
    else:
        with pytest.raises(ValueError, match="over NCCL use algorithm='ring'"):
            tfscale.CommunicationOptions(algorithm="auto", implementation="nccl")
    with pytest.raises(ValueError, match="only applies to algorithm='auto'"):
        tfscale.CommunicationOptions(hybrid_threshold_bytes=4096, autotune_dir="/tmp/x")
    for algorithm in ("auto", None):  # None: the default, auto over TF's ring
        options = tfscale.CommunicationOptions(algorithm=algorithm, autotune_dir="/tmp/x")
        assert options.autotune_dir == "/tmp/x"


def test_a_bad_cost_model_file_is_named(tmp_path):
    bad = tmp_path / "model.json"
    bad.write_text('{"intra": 3}')
    with pytest.raises(ValueError, match=f"{bad}.*holds no cost model"):
        cost_model_lib.load(str(bad))
    with pytest.raises(ValueError, match="missing.json.*does not exist"):
        cost_model_lib.load(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot be read"):
        cost_model_lib.load(str(tmp_path))  # a directory
    good = tmp_path / "fit.json"
    good.write_text(json.dumps({"cost_model": cost_model_lib.DEFAULT.get_config()}))
    assert cost_model_lib.load(str(good)) == cost_model_lib.DEFAULT


def test_an_unreadable_or_foreign_stored_choice_is_tried_again(tmp_path, caplog):
    (tmp_path / autotune.FILE_NAME).write_text("{not json")
    assert autotune.AutoTuner(directory=tmp_path, is_chief=True).plans == {}
    tuner = autotune.AutoTuner(directory=tmp_path, is_chief=True)
    tuner.report(autotune.TunedPlan("f #0; x", 0, 0, ("ring", "2d"), (None, "ring"), None),
                  np.array([1, 0]), np.array([[0.002, 0.001], [0.0, 0.0]]))
    stored = json.loads((tmp_path / autotune.FILE_NAME).read_text())
    assert stored["plans"][0]["choices"] == ["2d", "ring"]  # bucket 1's is fixed
    again = autotune.AutoTuner(directory=tmp_path, is_chief=True)
    assert again.tuned_plan("f #0; x", ("ring", "2d"), (None, "ring")).stored == [1, 0]
    # Other candidates (another topology's, another cost model's order): tried again.
    other = autotune.AutoTuner(directory=tmp_path, is_chief=True)
    assert other.tuned_plan("f #0; x", ("2d", "ring"), (None, "ring")).stored is None
    # A call the file has no choice for (another call's name): tried, and said.
    with caplog.at_level("INFO", logger="absl"):  # whatever level absl was left at
        assert other.tuned_plan("g #0; x", ("ring", "2d"), (None, "ring")).stored is None
    assert f"none of the 1 choices stored in {tmp_path / autotune.FILE_NAME} is for g #0" in caplog.text
    # A choice made in this run (`tuner` read nothing) is not one the file held.
    caplog.clear()
    with caplog.at_level("INFO", logger="absl"):
        assert tuner.tuned_plan("h #0; x", ("ring", "2d"), (None, "ring")).stored is None
    assert "choices stored in" not in caplog.text


def test_a_stored_threshold_is_restored_with_the_choice(tmp_path):
    tuner = autotune.AutoTuner(directory=tmp_path, is_chief=True)
    plan = autotune.TunedPlan("f #0; y", 0, 0, ("ring", "2d"), (None,) * 3, None,
                              thresholds=(4800, 1200), bucket_thresholds=(0, 1, 1))
    # The candidates' trials at each threshold, then (1200 bytes makes two
    # buckets that may differ) the mix's.
    assert plan.mixes and plan.trial_steps == 2 * 2 * (autotune.ROUNDS + 1) + 2 * autotune.ROUNDS
    tuner.report(plan, np.array([0, 1, 0]), np.full([3, 2], 0.004), threshold=1,
                 spans=np.array([[0.03, 0.05, 0.04], [0.02, 0.04, 0.01]]))
    (entry,) = json.loads((tmp_path / autotune.FILE_NAME).read_text())["plans"]
    assert entry["fusion_threshold_bytes"] == 1200 and entry["threshold_index"] == 1
    again = autotune.AutoTuner(directory=tmp_path, is_chief=True).tuned_plan(
        "f #0; y", ("ring", "2d"), (None,) * 3, (4800, 1200), (0, 1, 1))
    assert (again.stored_threshold, again.stored) == (1, [0, 1, 0])


def test_auto_tries_a_quarter_of_the_fusion_threshold_where_it_cuts_otherwise():
    """The plans of the thresholds tried (traced, never run): 4800 bytes
    make one bucket of the two tensors, 1200 two; with threshold 0, or on
    one node, one plan as before."""
    all_reduce, world = _auto_on_two_nodes(fusion_threshold_bytes=4800)
    inputs = [tf.zeros([n]) for n in (300, 900)]
    thresholds, plans = all_reduce.threshold_plans(inputs)
    assert thresholds == (4800, 1200) and [len(p) for p in plans] == [1, 2]
    assert [[a for a, _ in b.candidates] for b in plans[1]] == [
        [a for a, _ in plans[0][0].candidates]] * 2  # one order for both
    assert "Case" in _traced_op_types(all_reduce, world)
    (plan,) = all_reduce.autotuner.plans.values()
    assert plan.thresholds == (4800, 1200) and plan.bucket_thresholds == (0, 1, 1)
    assert plan.trial_steps == 2 * 3 * (autotune.ROUNDS + 1) + 2 * autotune.ROUNDS
    assert autotune.DECIDED_BY_STEP == plan.trial_steps + 1
    zero, _ = _auto_on_two_nodes(fusion_threshold_bytes=0)
    assert zero.threshold_plans(inputs)[0] == (0,)
    from tfscale import collectives

    flat = collectives.AllReduce(topology_lib.from_hosts(["a"] * 4, 0, None), "auto",
                                 fusion_threshold_bytes=4800, implementation="ring")
    assert flat.threshold_plans(inputs)[0] == (4800,)


def _flat(weights):
    return np.concatenate([np.asarray(w, np.float32).ravel() for w in weights])


@pytest.fixture(scope="module")
def autotuned(tmp_path_factory):
    """`autotuned(scenario)`: tests/workers/autotune_fit.py's `scenario` on 4
    workers in 2 nodes of 2, run once (in reused workers); `restarted` finds
    what `default` stored."""
    tmp_path = tmp_path_factory.mktemp("autotune")
    runs = {}

    def run(scenario):
        if scenario == "restarted":
            run("default")
        if scenario not in runs:
            runs[scenario] = multiworker.run_workers(
                "autotune_fit.py", 4, tmp_path / scenario.replace("+", "_"),
                args=[f"--scenario={scenario}", f"--autotune_dir={tmp_path / 'model_dir'}",
                      "--steps=27"], timeout=300)
            multiworker.assert_succeeded(runs[scenario])
        return runs[scenario]

    return run


def _results(run):
    return [r["result"] for r in run.results]


def _chief_lines(run):
    return [l for l in run.output.splitlines() if l.startswith("[worker 0]")]


def _gradients(result):
    """The gradients' plan: 1 bucket at 1024 bytes, 2 at 256."""
    (plan,) = [p for p in result["autotune"] if p["fusion_thresholds"] == [1024, 256]]
    return plan


def _assert_alike_and_near_the_ring(autotuned, scenario):
    """Every worker the same weights; within float32 rounding of the ring
    (the sums run in another order)."""
    results = _results(autotuned(scenario))
    for other in results[1:]:
        np.testing.assert_array_equal(_flat(other["weights"]), _flat(results[0]["weights"]))
    ring = _flat(_results(autotuned("ring"))[0]["weights"])
    relative = np.max(np.abs(_flat(results[0]["weights"]) - ring))
    assert relative / np.max(np.abs(ring)) <= 1e-5, (scenario, relative)


def _assert_only_the_chief_logs_choices(run):
    assert not [l for l in run.output.splitlines()
                if "tfscale autotune: chose" in l and not l.startswith("[worker 0]")]


@pytest.mark.multiworker
def test_four_workers_by_default_try_each_candidate_and_threshold_agree_on_one_choice_and_match_the_ring(
        autotuned):
    _assert_alike_and_near_the_ring(autotuned, "default")
    run = autotuned("default")
    results = _results(run)
    # The default (algorithm=None) on 2 nodes is auto.
    assert {r["algorithm"] for r in results} == {"auto"}
    tuned = [_gradients(r) for r in results]
    # 3 candidates; 18 steps of their trials, 4 of each bucket's fastest
    # together, decided.
    assert tuned[0]["candidates"] and set(tuned[0]["candidates"]) == {
        "ring", "hierarchical", "2d"}
    # 27 steps ran, 3 per execution; the tuner counted 24: after the
    # decision (step 22) fit traced its train function again, and the last
    # execution ran the choice as a fixed plan, without the trials' cases.
    assert tuned[0]["steps"] == 24
    for plan in tuned:
        assert plan["retraced"]
        assert plan["choices"] == tuned[0]["choices"]  # one choice everywhere
        assert plan["fusion_threshold_bytes"] == tuned[0]["fusion_threshold_bytes"]
        # Each candidate timed on each bucket, and the call at each
        # threshold with each candidate and with the mix, in the timed rounds.
        assert np.all(np.asarray(plan["seconds"]) > 0), plan["seconds"]
        assert np.all(np.asarray(plan["span_seconds"]) > 0), plan["span_seconds"]
        assert np.all(np.asarray(plan["mix_span_seconds"]) > 0), plan["mix_span_seconds"]
    # The call kept the threshold and the configuration (one candidate for
    # every bucket, or the mix: each bucket its fastest) with the least span,
    # per round the least over the workers, summed over the rounds.
    spans = np.min([np.concatenate([plan["span_seconds"],
                                    np.asarray(plan["mix_span_seconds"])[:, None]], axis=1)
                    for plan in tuned], axis=0).sum(axis=2)
    threshold, configuration = np.unravel_index(np.argmin(spans), spans.shape)
    assert tuned[0]["fusion_threshold_bytes"] == [1024, 256][threshold], spans
    assert len(tuned[0]["choices"]) == {1024: 1, 256: 2}[tuned[0]["fusion_threshold_bytes"]]
    # A bucket's fastest: per round the least time over the workers (about
    # the worker ready last), summed over the rounds.
    least = np.min([plan["seconds"] for plan in tuned], axis=0).sum(axis=2)
    fastest = [tuned[0]["candidates"][i] for i in np.argmin(least, axis=1)]
    assert tuned[0]["choices"] == (
        fastest if configuration == 3
        else [tuned[0]["candidates"][configuration]] * len(fastest)), (spans, least)
    # The chief stored it.
    stored = run.results[0]["stored"]
    (entry,) = [p for p in stored["plans"] if "fusion_threshold_bytes" in p]
    assert entry["fusion_threshold_bytes"] == tuned[0]["fusion_threshold_bytes"]
    # Its choices list the 1024-byte plan's bucket, then the 256-byte plan's two.
    rows = {1024: slice(0, 1), 256: slice(1, 3)}[entry["fusion_threshold_bytes"]]
    assert entry["choices"][rows] == tuned[0]["choices"]
    chief = _chief_lines(run)
    assert any("tfscale autotune: " in l and "chose after 22 trial steps" in l
               for l in chief)
    assert any("auto: the plans at fusion thresholds 1,024 bytes (1 bucket(s)) and 256 "
               "bytes (2 bucket(s)) take turns" in l for l in chief)
    assert any("auto: the choice made after 22 trial steps, traced again as a fixed "
               "plan at fusion threshold" in l for l in chief)
    _assert_only_the_chief_logs_choices(run)


@pytest.mark.multiworker
def test_a_restarted_job_takes_the_stored_choice_tries_nothing_and_backs_up_its_end(
        autotuned):
    _assert_alike_and_near_the_ring(autotuned, "restarted")
    run = autotuned("restarted")
    tuned = _gradients(_results(autotuned("default"))[0])
    for result in _results(run):
        assert result["algorithm"] == "auto"
        restarted = _gradients(result)
        assert restarted["choices"] == tuned["choices"]
        assert restarted["fusion_threshold_bytes"] == tuned["fusion_threshold_bytes"]
        assert not np.any(restarted["seconds"]) and not np.any(restarted["span_seconds"])
        assert not np.any(restarted["mix_span_seconds"])
        # Its first step agreed on the stored choice; the other 26 ran it
        # traced as a fixed plan, under BackupAndRestore, which saved the end.
        assert restarted["retraced"] and restarted["steps"] == 23
    assert _results(run)[0]["backup"]["step"] == 27
    chief = _chief_lines(run)
    assert any("auto: the choice stored in" in l for l in chief)
    assert any("auto: the stored choice, traced again as a fixed plan" in l for l in chief)
    _assert_only_the_chief_logs_choices(run)


@pytest.mark.multiworker
def test_powersgd_under_the_default_tunes_its_compressed_all_reduces_alike_everywhere(
        autotuned):
    # The all-reduces of its compressed steps (from step 2 on: the factors'
    # and the uncompressed biases') tried the candidates and chose, alike on
    # every worker, in 12 calls; of 14 compressed steps the last 2 ran the
    # choice traced again as a fixed plan (the counts stop at 12), though the
    # all-reduce of the first two, uncompressed, steps never chose.
    results = _results(autotuned("default+powersgd"))
    for other in results[1:]:
        np.testing.assert_array_equal(_flat(other["weights"]), _flat(results[0]["weights"]))
    assert {r["algorithm"] for r in results} == {"auto"}
    powersgd = [r["autotune"] for r in results]
    compressed = [p for p in powersgd[0] if p["steps"] == 12]
    assert len(compressed) >= 2, powersgd[0]
    for plan in compressed:
        assert plan["retraced"]
        assert set(plan["candidates"]) == {"ring", "hierarchical", "2d"}
        assert np.all(np.asarray(plan["seconds"]) > 0) and plan["choices"] is not None
    for plans in powersgd[1:]:
        assert [p["choices"] for p in plans] == [p["choices"] for p in powersgd[0]]
    assert np.all(np.isfinite(_flat(results[0]["weights"])))


@pytest.mark.multiworker
def test_a_custom_loop_built_anew_when_retrace_due_runs_the_choice_as_a_fixed_plan(
        autotuned):
    # Every worker builds its tf.function anew at the step of the decision,
    # then runs the choice traced as a fixed plan (the tuner's count stops).
    _assert_alike_and_near_the_ring(autotuned, "custom_loop")
    results = _results(autotuned("custom_loop"))
    for loop in results:
        assert loop["algorithm"] == "auto"
        assert loop["built_anew"] == [22], loop["built_anew"]
        plan = _gradients(loop)
        assert plan["retraced"] and plan["steps"] == 23
        assert plan["choices"] == _gradients(results[0])["choices"]


@pytest.mark.multiworker
def test_a_train_function_wrapped_on_the_chief_only_is_traced_again_nowhere(autotuned):
    # No worker traces it again (all 25 steps counted everywhere, and no
    # hang), and the chief says why.
    run = autotuned("chief_wrapped")
    results = _results(run)
    for other in results[1:]:
        np.testing.assert_array_equal(_flat(other["weights"]), _flat(results[0]["weights"]))
    for result in results:
        assert result["algorithm"] == "auto"
        plan = _gradients(result)
        assert plan["steps"] == 25 and not plan["retraced"] and plan["choices"]
    assert any("wrapped by code tfscale does not know on worker(s) 0, so no worker "
               "traces it again" in l for l in _chief_lines(run))
    _assert_only_the_chief_logs_choices(run)


def test_beyond_the_tuners_limits_a_call_is_not_tuned():
    """Past MAX_BUCKETS a call gets no plan (`AllReduce` then runs the cost
    model's choice, as inside XLA), not an error: the default would otherwise
    fail jobs that never asked for auto."""
    tuner = autotune.AutoTuner()
    assert tuner.tuned_plan("a", ("ring", "2d"), [None] * autotune.MAX_BUCKETS)
    assert tuner.tuned_plan("b", ("ring", "2d"), [None]) is None
    assert list(tuner.plans) == ["a"]


def _auto_on_two_nodes(fusion_threshold_bytes=0):
    """An "auto" `AllReduce` on 2 nodes of 2 and a group to trace it with on
    this CPU (no peers: only traced, never run)."""
    from tfscale import collectives
    from tfscale._private import tf_collectives

    cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    topology = topology_lib.from_hosts(["a", "a", "b", "b"], 0, 2)
    world = tf_collectives.standalone_group(
        4, cpu, "ring", max_subgroup_index=collectives.topology.MAX_SUBGROUP_INDEX)
    return collectives.AllReduce(topology, "auto",
                                 fusion_threshold_bytes=fusion_threshold_bytes,
                                 implementation="ring"), world


def _traced_op_types(all_reduce, world, jit_compile=False):
    # autograph=False: as Keras traces a step (its step functions are
    # `do_not_convert`); converting the all-reduce's Python takes seconds.
    function = tf.function(lambda *t: all_reduce(list(t), world),
                           jit_compile=jit_compile, autograph=False)
    graph = function.get_concrete_function(
        *[tf.TensorSpec([n], tf.float32) for n in (300, 900)]).graph
    return {op.type for op in graph.get_operations()}


def test_inside_xla_auto_takes_the_cost_models_choice_and_tries_nothing():
    """XLA has no tf.timestamp: a step compiled with jit_compile=True runs
    each bucket's fastest prediction, no switch, no trials (traced graph)."""
    all_reduce, world = _auto_on_two_nodes()
    ops = {jit_compile: _traced_op_types(all_reduce, world, jit_compile)
           for jit_compile in (False, True)}
    assert "Case" in ops[False] and "Case" not in ops[True]
    assert "CollectiveReduceV2" in ops[True]
    # Only the traced call without XLA made a plan to tune.
    assert len(all_reduce.autotuner.plans) == 1


def test_under_op_determinism_auto_takes_the_cost_models_choice_and_tries_nothing():
    """Runs that must repeat each other bit for bit cannot choose by
    timings: with op determinism on, each bucket runs the cost model's
    fastest prediction, no switch, no trials (traced graph); off again, it
    tunes (this also fails if the private getter stops answering)."""
    # TensorFlow's own switch back, so that later tests run as before.
    from tensorflow.python.framework import config as tf_config

    all_reduce, world = _auto_on_two_nodes()
    tf.config.experimental.enable_op_determinism()
    try:
        deterministic = _traced_op_types(all_reduce, world)
    finally:
        tf_config.disable_op_determinism()
    assert "Case" not in deterministic and "CollectiveReduceV2" in deterministic
    assert not all_reduce.autotuner.plans
    assert "Case" in _traced_op_types(all_reduce, world)
    assert len(all_reduce.autotuner.plans) == 1
