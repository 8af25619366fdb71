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


@pytest.mark.multiworker
def test_four_workers_by_default_try_each_candidate_and_threshold_agree_on_one_choice_and_match_the_ring(
        tmp_path):
    autotune_dir = tmp_path / "model_dir"
    run = multiworker.run_workers(
        "autotune_fit.py", 4, tmp_path,
        args=[f"--autotune_dir={autotune_dir}", "--steps=27"], timeout=300)
    multiworker.assert_succeeded(run)
    results = [r["results"] for r in run.results]
    names = ("ring", "default", "restarted", "default+powersgd", "custom_loop",
             "chief_wrapped")
    for name in names:  # every worker the same weights
        for other in results[1:]:
            np.testing.assert_array_equal(_flat(other[name]["weights"]),
                                          _flat(results[0][name]["weights"]), err_msg=name)
    ring = _flat(results[0]["ring"]["weights"])
    for name in ("default", "restarted", "custom_loop"):  # sums in another order
        relative = np.max(np.abs(_flat(results[0][name]["weights"]) - ring))
        assert relative / np.max(np.abs(ring)) <= 1e-5, (name, relative)

    # The gradients' plan: 1 bucket at 1024 bytes, 2 at 256; 3 candidates;
    # 18 steps of their trials, 4 of each bucket's fastest together, decided.
    def gradients(result):
        (plan,) = [p for p in result["autotune"] if p["fusion_thresholds"] == [1024, 256]]
        return plan

    # The default (algorithm=None) on 2 nodes is auto, as is the restart's
    # algorithm="auto".
    assert {r[name]["algorithm"] for r in results for name in names[1:]} == {"auto"}
    tuned = [gradients(r["default"]) for r in results]
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
    # The chief stored it; the restarted job took it and tried nothing.
    stored = run.results[0]["stored"]
    (entry,) = [p for p in stored["plans"] if "fusion_threshold_bytes" in p]
    assert entry["fusion_threshold_bytes"] == tuned[0]["fusion_threshold_bytes"]
    # Its choices list the 1024-byte plan's bucket, then the 256-byte plan's two.
    rows = {1024: slice(0, 1), 256: slice(1, 3)}[entry["fusion_threshold_bytes"]]
    assert entry["choices"][rows] == tuned[0]["choices"]
    for result in results:
        restarted = gradients(result["restarted"])
        assert restarted["choices"] == tuned[0]["choices"]
        assert restarted["fusion_threshold_bytes"] == tuned[0]["fusion_threshold_bytes"]
        assert not np.any(restarted["seconds"]) and not np.any(restarted["span_seconds"])
        assert not np.any(restarted["mix_span_seconds"])
        # Its first step agreed on the stored choice; the other 26 ran it
        # traced as a fixed plan, under BackupAndRestore, which saved the end.
        assert restarted["retraced"] and restarted["steps"] == 23
    assert results[0]["restarted"]["backup"]["step"] == 27
    # PowerSGD under the default: the all-reduces of its compressed steps
    # (from step 2 on: the factors' and the uncompressed biases') tried the
    # candidates and chose, alike on every worker, in 12 calls; of 14
    # compressed steps the last 2 ran the choice traced again as a fixed
    # plan (the counts stop at 12), though the all-reduce of the first two,
    # uncompressed, steps never chose.
    powersgd = [r["default+powersgd"]["autotune"] for r in results]
    compressed = [p for p in powersgd[0] if p["steps"] == 12]
    assert len(compressed) >= 2, powersgd[0]
    for plan in compressed:
        assert plan["retraced"]
        assert set(plan["candidates"]) == {"ring", "hierarchical", "2d"}
        assert np.all(np.asarray(plan["seconds"]) > 0) and plan["choices"] is not None
    for plans in powersgd[1:]:
        assert [p["choices"] for p in plans] == [p["choices"] for p in powersgd[0]]
    assert np.all(np.isfinite(_flat(results[0]["default+powersgd"]["weights"])))
    # A custom loop that builds its tf.function anew when retrace_due()
    # says so: every worker at the step of the decision, then the choice
    # traced as a fixed plan (the tuner's count stops there).
    for result in results:
        loop = result["custom_loop"]
        assert loop["built_anew"] == [22], loop["built_anew"]
        plan = gradients(loop)
        assert plan["retraced"] and plan["steps"] == 23
        assert plan["choices"] == gradients(results[0]["custom_loop"])["choices"]
    # Where the chief's train function is wrapped by code tfscale does not
    # know, no worker traces it again (all 25 steps counted everywhere, and
    # no hang), and the chief says why.
    for result in results:
        plan = gradients(result["chief_wrapped"])
        assert plan["steps"] == 25 and not plan["retraced"] and plan["choices"]
    chief = [l for l in run.output.splitlines() if l.startswith("[worker 0]")]
    assert any("wrapped by code tfscale does not know on worker(s) 0, so no worker "
               "traces it again" in l for l in chief)
    assert any("tfscale autotune: " in l and "chose after 22 trial steps" in l
               for l in chief)
    assert any("auto: the plans at fusion thresholds 1,024 bytes (1 bucket(s)) and 256 "
               "bytes (2 bucket(s)) take turns" in l for l in chief)
    assert any("auto: the choice stored in" in l for l in chief)
    assert any("auto: the choice made after 22 trial steps, traced again as a fixed "
               "plan at fusion threshold" in l for l in chief)
    assert any("auto: the stored choice, traced again as a fixed plan" in l for l in chief)
    assert not [l for l in run.output.splitlines()
                if "tfscale autotune: chose" in l and not l.startswith("[worker 0]")]


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
    function = tf.function(lambda *t: all_reduce(list(t), world), jit_compile=jit_compile)
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
