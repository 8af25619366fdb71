"""tfscale.collectives: fusion, compression, planning, and every algorithm run
by real worker processes on 127.0.0.1 (4 workers as 2 nodes x 2, 3 workers as
2 + 1), checked against float64 NumPy sums and against each other."""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from multiworker import REPO_ROOT
from multiworker import assert_succeeded
from multiworker import run_workers
from tfscale import collectives
from tfscale.collectives import compression
from tfscale.collectives import cost_model
from tfscale.collectives import fusion
from tfscale.collectives import topology

F32_U = 2.0**-24  # float32 unit roundoff


# ---------------------------------------------------------------- fusion


def test_buckets_close_at_threshold_and_at_dtype_change():
    sizes = [100, 100, 100, 8, 8, 400]
    dtypes = [tf.float32] * 3 + [tf.int32] * 2 + [tf.float32]
    assert fusion.bucket_indices(sizes, dtypes, 150) == [[0, 1], [2], [3, 4], [5]]
    assert fusion.bucket_indices(sizes, dtypes, 0) == [[i] for i in range(6)]
    assert fusion.bucket_indices(sizes, dtypes, 10**9) == [[0, 1, 2], [3, 4], [5]]


def test_pack_and_unpack_are_mirror_images():
    tensors = [tf.reshape(tf.range(12.0), [3, 4]), tf.constant(5.0),
               tf.ones([2, 1, 3])]
    buffer, shapes = fusion.pack(tensors)
    assert buffer.shape == [12 + 1 + 6]
    for original, restored in zip(tensors, fusion.unpack(buffer, shapes), strict=True):
        np.testing.assert_array_equal(restored, original)
    single, shapes = fusion.pack(tensors[:1])
    np.testing.assert_array_equal(fusion.unpack(single, shapes)[0], tensors[0])


# ---------------------------------------------------------------- compression


def _own_max(value):
    # One worker: the maximum over all workers is its own.
    return value


def test_bfloat16_round_trip_error_is_one_rounding():
    x = tf.constant(np.random.default_rng(0).normal(size=1000) * 1e-5, tf.float32)
    wire, context = compression.compress(x, "bfloat16", 1, _own_max)
    assert wire.dtype == tf.bfloat16
    back = compression.decompress(wire, context)
    assert back.dtype == tf.float32
    assert np.all(np.abs(back - x) <= 2.0**-8 * np.abs(x))


def test_float16_scale_keeps_the_sum_of_n_workers_below_65504():
    x = tf.constant([60000.0, -3.0, 1e-3], tf.float32)
    wire, context = compression.compress(x, "float16", 4, _own_max)
    assert wire.dtype == tf.float16
    # The largest value times 4 workers must fit: 60000 * 4 * scale <= 65504.
    assert 4 * float(np.max(np.abs(wire.numpy().astype(np.float64)))) <= 65504
    np.testing.assert_allclose(compression.decompress(wire, context), x, rtol=2.0**-11)


def test_float16_of_tiny_values_is_scaled_up_not_flushed():
    x = tf.constant([1e-9, -2e-9, 3e-10], tf.float32)  # below float16's 6e-8
    wire, context = compression.compress(x, "float16", 2, _own_max)
    np.testing.assert_allclose(compression.decompress(wire, context), x, rtol=2.0**-11)


def test_float16_zeros_and_non_finite_values():
    zeros = tf.zeros([3])
    wire, context = compression.compress(zeros, "float16", 4, _own_max)
    np.testing.assert_array_equal(compression.decompress(wire, context), zeros)
    for bad in (np.inf, np.nan):
        x = tf.constant([1.0, bad], tf.float32)
        wire, context = compression.compress(x, "float16", 4, _own_max)
        assert not np.all(np.isfinite(compression.decompress(wire, context)))


def test_only_float32_is_compressed():
    x = tf.constant([1, 2], tf.int32)
    wire, context = compression.compress(x, "bfloat16", 2, _own_max)
    assert wire is x and compression.decompress(wire, context) is x
    assert compression.wire_dtype(tf.float64, "float16") == tf.float64


# ---------------------------------------------------------------- plan


TWO_BY_TWO = topology.from_hosts(["h"] * 4, rank=0, local_size=2)
ONE_NODE = topology.from_hosts(["h"] * 4, rank=0)


def _plan(algorithm, sizes, topo=TWO_BY_TWO, dtypes=None, **kwargs):
    dtypes = dtypes or [tf.float32] * len(sizes)
    return collectives.plan(sizes, dtypes, topo, algorithm, 1000, **kwargs)


def test_hybrid_picks_hierarchical_below_the_threshold_and_ring_at_it():
    buckets = _plan("hybrid", [400, 800, 1000, 4], hybrid_threshold_bytes=1000)
    assert [b.indices for b in buckets] == [(0, 1), (2,), (3,)]
    assert [b.algorithm for b in buckets] == ["ring", "ring", "hierarchical"]


def test_hybrid_threshold_counts_bytes_on_the_wire():
    buckets = _plan("hybrid", [1200], hybrid_threshold_bytes=1000,
                    compression="bfloat16")
    assert buckets[0].wire_bytes == 600
    assert buckets[0].algorithm == "hierarchical"


def test_one_node_degrades_the_hierarchical_algorithms_to_ring():
    for algorithm in ("hierarchical", "2d"):
        assert {b.algorithm for b in _plan(algorithm, [4, 4000], topo=ONE_NODE)} == {"ring"}
    assert {b.algorithm for b in _plan(
        "halving_doubling", [4, 4000], topo=ONE_NODE)} == {"halving_doubling"}
    assert {b.algorithm for b in _plan(
        "hybrid", [4, 4000], topo=ONE_NODE, hybrid_threshold_bytes=1000)} == {"ring"}


def test_hybrid_without_a_threshold_takes_the_fastest_prediction_of_ring_and_hierarchical():
    # The model once fitted on the emulated 2 x 2 cluster (tests/data): the ring
    # wins the smallest buffers, halving-doubling the middle by its
    # prediction, hierarchical the largest. Halving-doubling is not among
    # hybrid's choices (measured slowest on small buffers: BENCHMARKS.md,
    # section "The fixed cost of one collective"): the middle goes to the
    # faster of the other two.
    with open(os.path.join(REPO_ROOT, "tests", "data", "cost_model_fit_emulated_2x2.json")) as f:
        fitted = cost_model.CostModel.from_config(json.load(f)["cost_model"])
    even = cost_model.CostModel(intra=cost_model.Link(1e-4, 1e-9),
                                inter=cost_model.Link(1e-4, 1e-9))
    three = topology.from_hosts(["h"] * 3, rank=0, local_size=2)
    chosen = set()
    for model in (fitted, even, cost_model.DEFAULT):
        for topo in (TWO_BY_TWO, ONE_NODE, three):
            for size in (4, 4096, 65536, 1 << 20, 32 << 20):
                [bucket] = collectives.plan([size], [tf.float32], topo, "hybrid",
                                            size, cost_model=model)
                predicted = {a: model.predict(a, size, topo.node_sizes)
                             for a in ("ring", "hierarchical")}
                fastest = min(predicted.values())
                assert predicted[bucket.algorithm] == fastest, (topo, size, predicted)
                chosen.add(bucket.algorithm)
    assert chosen == {"ring", "hierarchical"}
    assert fitted.predict("halving_doubling", 65536, TWO_BY_TWO.node_sizes) < min(
        fitted.predict(a, 65536, TWO_BY_TWO.node_sizes) for a in ("ring", "hierarchical"))
    plan = [collectives.plan([size], [tf.float32], TWO_BY_TWO, "hybrid", size,
                             cost_model=fitted)[0].algorithm
            for size in (4, 65536, 32 << 20)]
    assert "halving_doubling" not in plan and plan[-1] == "hierarchical"


def test_hybrid_with_a_given_threshold_never_takes_halving_doubling():
    buckets = _plan("hybrid", [4, 400, 4000], hybrid_threshold_bytes=1000)
    assert {b.algorithm for b in buckets} <= {"ring", "hierarchical"}


def test_shapes_known_only_at_run_time_go_by_ring():
    assert _plan("hierarchical", [0])[0].algorithm == "ring"
    assert _plan("2d", [400, 0, 400])[0].algorithm == "ring"
    assert _plan("halving_doubling", [0])[0].algorithm == "ring"


def test_lone_scalars_and_other_dtypes_are_not_compressed():
    buckets = _plan("ring", [4, 8, 2000], compression="float16",
                    dtypes=[tf.float32, tf.int64, tf.float32])
    assert [b.wire_dtype for b in buckets] == [tf.float32, tf.int64, tf.float16]


def test_large_hierarchical_buckets_are_pipelined_in_chunks():
    buckets = collectives.plan([64 << 20], [tf.float32], TWO_BY_TWO, "2d", 64 << 20)
    assert buckets[0].num_chunks == cost_model.DEFAULT.best_num_chunks(
        "2d", 64 << 20, (2, 2)) > 1


def test_2d_refuses_unequal_nodes_and_says_what_to_use():
    two_plus_one = topology.from_hosts(["h"] * 3, rank=0, local_size=2)
    with pytest.raises(NotImplementedError, match=re.escape(
            "algorithm='2d' needs nodes with the same number of workers; this "
            "cluster has 3 workers in 2 nodes of sizes [2, 1]. Use "
            "algorithm='hierarchical' or 'hybrid'")):
        collectives.AllReduce(two_plus_one, "2d", 1000)
    collectives.AllReduce(two_plus_one, "hierarchical", 1000)  # fine


def test_halving_doubling_refuses_more_workers_than_its_pair_groups_fit():
    huge = topology.from_hosts(["h"] * 16384, rank=0, local_size=8)
    with pytest.raises(NotImplementedError, match=re.escape(
            "algorithm='halving_doubling' needs more pair groups on 16,384 workers "
            "than a strategy's collective keys hold. Use algorithm='ring', "
            "'hierarchical' or 'hybrid'.")):
        collectives.AllReduce(huge, "halving_doubling", 1000)
    # hybrid then chooses between the other two.
    assert collectives.plan([4], [tf.float32], huge, "hybrid", 4)[0].algorithm in (
        "ring", "hierarchical")


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match=re.escape(
            "Argument `algorithm` must be one of ['ring', 'hierarchical', '2d', "
            "'halving_doubling', 'hybrid', 'auto']. Received: algorithm='tree'")):
        collectives.AllReduce(TWO_BY_TWO, "tree", 1000)


# ---------------------------------------------------------------- real workers


@pytest.fixture(scope="module")
def all_reduce_runs(tmp_path_factory):
    """collectives_all_reduce.py as 4 workers in 2 nodes x 2 and as 2 + 1."""
    tmp_path = tmp_path_factory.mktemp("collectives")
    runs = {}
    for num_workers in (4, 3):
        run = run_workers("collectives_all_reduce.py", num_workers, tmp_path,
                          args=["--local_size=2"], timeout=180)
        assert_succeeded(run)
        runs[num_workers] = run
    return runs


def _sum64(results, key):
    count = len(results[0][key])
    return [np.sum([np.asarray(r[key][i], np.float64) for r in results], axis=0)
            for i in range(count)]


def _abs_sum64(results, key):
    count = len(results[0][key])
    return [np.sum([np.abs(np.asarray(r[key][i], np.float64)) for r in results], axis=0)
            for i in range(count)]


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers,nodes", [(4, [[0, 1], [2, 3]]), (3, [[0, 1], [2]])])
def test_workers_are_grouped_into_nodes_by_local_size(all_reduce_runs, num_workers, nodes):
    for result in all_reduce_runs[num_workers].results:
        assert result["nodes"] == nodes


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [4, 3])
def test_every_algorithm_sums_integer_valued_floats_exactly(all_reduce_runs, num_workers):
    results = all_reduce_runs[num_workers].results
    expected = _sum64(results, "integer_inputs")
    names = {"ring", "hierarchical", "hybrid"} | ({"2d"} if num_workers == 4 else set())
    assert set(results[0]["integer"]) == names
    for result in results:  # each Strategy's tfscale all-reduce: 7 integer
        assert result["routed"] == {name: [7, 6] for name in names}  # then 6 real
    for name in names:
        for result in results:
            for got, want in zip(result["integer"][name], expected, strict=True):
                np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [4, 3])
def test_every_algorithm_is_within_float32_rounding_of_the_float64_sum(
        all_reduce_runs, num_workers):
    results = all_reduce_runs[num_workers].results
    expected = _sum64(results, "real_inputs")
    bound = [num_workers * F32_U * a for a in _abs_sum64(results, "real_inputs")]
    for name, reduced in results[0]["real"].items():
        for got, want, b in zip(reduced, expected, bound, strict=True):
            assert np.all(np.abs(np.asarray(got) - want) <= b), name
        # Every worker holds the very same bits.
        for result in results[1:]:
            assert result["real"][name] == reduced, name


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [4, 3])
def test_chunked_and_padded_algorithms_sum_exactly(all_reduce_runs, num_workers):
    results = all_reduce_runs[num_workers].results
    expected = np.sum([r["buffer"] for r in results], axis=0)
    keys = {"ring/1", "ring/3", "hierarchical/1", "hierarchical/3",
            "halving_doubling/1", "halving_doubling/3"}
    if num_workers == 4:
        keys |= {"2d/1", "2d/3"}
    assert set(results[0]["chunked"]) == keys
    for result in results:
        for key, got in result["chunked"].items():
            np.testing.assert_array_equal(got, expected, err_msg=key)


@pytest.mark.multiworker
def test_hybrid_plan_mixes_hierarchical_and_ring(all_reduce_runs):
    plans = all_reduce_runs[4].results[0]["plans"]
    # Buckets, last tensors first: the 1000-element one (4,132 bytes) is
    # above the 2,048-byte threshold.
    assert [p[0] for p in plans["hybrid"]] == [
        "hierarchical", "ring", "hierarchical", "hierarchical"]
    assert {p[0] for p in plans["2d"]} == {"2d"}


@pytest.mark.multiworker
def test_hybrid_under_a_fitted_cost_model_follows_its_prediction(all_reduce_runs):
    # CommunicationOptions(algorithm="hybrid", cost_model=fitted) -> Strategy:
    # the 32 MiB bucket goes by whichever the fitted model predicts faster
    # (hierarchical, though that model's ring/hierarchical threshold is 0).
    with open(os.path.join(REPO_ROOT, "tests", "data", "cost_model_fit_emulated_2x2.json")) as f:
        fitted = cost_model.CostModel.from_config(json.load(f)["cost_model"])
    size = 32 << 20
    hierarchical = fitted.predict("hierarchical", size, (2, 2))
    ring = fitted.predict("ring", size, (2, 2))
    assert hierarchical < 0.8 * ring
    for result in all_reduce_runs[4].results:
        [(algorithm, size_bytes, num_chunks)] = result["plans"]["hybrid/fitted"]
        assert (algorithm, size_bytes) == ("hierarchical", size)
        assert num_chunks == fitted.best_num_chunks("hierarchical", size, (2, 2))


@pytest.mark.multiworker
def test_3_workers_refuse_2d_clearly(all_reduce_runs):
    for result in all_reduce_runs[3].results:
        assert set(result["refused"]) == {"2d"}
        assert "nodes of sizes [2, 1]" in result["refused"]["2d"]


@pytest.mark.parametrize("wire,unit", [
    ("bfloat16", 2.0**-8), ("float16", 2.0**-11), ("2d/bfloat16", 2.0**-8)])
@pytest.mark.multiworker
def test_compressed_error_is_within_n_roundings(all_reduce_runs, wire, unit):
    results = all_reduce_runs[4].results
    n = len(results)
    expected = _sum64(results, "real_inputs")
    abs_sums = _abs_sum64(results, "real_inputs")
    # float16 also loses what falls below its smallest subnormal after the
    # power-of-two scale: at most 2**-25 / scale per rounding, and
    # 1 / scale <= 2 n max|x| / 65504.
    largest = max(np.max(np.abs(r)) for r in _abs_sum64(results, "real_inputs"))
    floor = 0.0
    if wire.split("/")[-1] == "float16":
        floor = n * 2.0**-25 * 2 * n * largest / 65504
    worst = 0.0
    for got, want, a in zip(results[0]["compressed"][wire], expected, abs_sums, strict=True):
        error = np.abs(np.asarray(got) - want)
        assert np.all(error <= n * unit * a + floor)
        worst = max(worst, float(np.max(error / np.maximum(a, 1e-300))))
    for result in results[1:]:
        assert result["compressed"][wire] == results[0]["compressed"][wire]
    # Measured: a bit above half the bound, far above float32's error.
    print(f"{wire}: worst |error| / sum|x| = {worst:.3g} = {worst / unit:.2f} u")
    assert worst > 100 * F32_U


@pytest.mark.multiworker
def test_float16_does_not_overflow_where_the_sum_exceeds_65504(all_reduce_runs):
    results = all_reduce_runs[4].results
    inputs = np.sum([r["extreme_inputs"][0] for r in results], axis=0)
    got = np.asarray(results[0]["compressed"]["float16/extreme"][0])
    assert np.abs(inputs[0]) > 65504 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got[[0, 1, 3]], inputs[[0, 1, 3]], rtol=4 * 2.0**-11)
    # Each 1e-9 * (rank + 1) is about 2**-48 of the largest input (2.4e5):
    # below float16's reach even after scaling.
    assert got[2] == 0.0


@pytest.mark.multiworker
def test_plans_are_logged_once_on_the_chief_only(all_reduce_runs):
    output = all_reduce_runs[4].output
    lines = [l for l in output.splitlines() if "tfscale all-reduce of" in l]
    assert lines and all(l.startswith("[worker 0]") for l in lines)
    hybrid = [l for l in lines if "algorithm=hybrid" in l]
    assert len(hybrid) == 2  # integer and real inputs differ (an int32 tensor)
    assert "[worker 0]   bucket 1: 2 tensor(s), 4,132 bytes float32: ring" in (
        output.splitlines())


# ---------------------------------------------------------------- Keras fit


FIT_CONFIGS = {
    4: ["ring", "hierarchical", "2d", "hybrid", "hierarchical+bfloat16",
        "ring+float16"],
    # "default": CommunicationOptions() as most users leave it (auto here);
    # with float16 its candidates also agree on each buffer's scale.
    3: ["ring", "hierarchical", "hybrid", "halving_doubling", "default",
        "default+float16"],
}
# 3 workers: auto's 16 trial steps (2 candidates at 2 fusion thresholds,
# then each bucket's fastest together at both) and its decision.
FIT_STEPS = {4: 6, 3: 19}


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("collectives_fit")
    runs = {}
    for num_workers, configs in FIT_CONFIGS.items():
        run = run_workers("collectives_fit.py", num_workers, tmp_path,
                          args=["--local_size=2", "--configs=" + ",".join(configs),
                                f"--steps={FIT_STEPS[num_workers]}"],
                          timeout=180)
        assert_succeeded(run)
        runs[num_workers] = run
    return runs


def _flat(weights):
    return np.concatenate([np.asarray(w, np.float32).ravel() for w in weights])


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [4, 3])
def test_fit_gives_bitwise_identical_weights_on_all_workers(fit_runs, num_workers):
    results = fit_runs[num_workers].results
    assert set(results[0]["results"]) == set(FIT_CONFIGS[num_workers])
    for result in results:  # the 4 gradients went through each Strategy's tfscale
        for config, sizes in result["all_reduce_batch_sizes"].items():
            assert 4 in sizes, (config, sizes)
    for config in FIT_CONFIGS[num_workers]:
        weights = _flat(results[0]["results"][config]["weights"])
        for result in results[1:]:
            np.testing.assert_array_equal(
                _flat(result["results"][config]["weights"]), weights, err_msg=config)


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", [4, 3])
def test_fit_with_each_algorithm_matches_ring(fit_runs, num_workers):
    results = fit_runs[num_workers].results[0]["results"]
    ring = _flat(results["ring"]["weights"])
    # Training moved the weights far more than the tolerance below.
    initial = _flat(fit_runs[num_workers].results[0]["initial"])
    assert np.max(np.abs(ring - initial)) / np.max(np.abs(ring)) > 1e-2
    for config, result in results.items():
        weights = _flat(result["weights"])
        relative = np.max(np.abs(weights - ring)) / np.max(np.abs(ring))
        if "+" in config:
            # 16 bits on the wire: close, not equal.
            assert 0 < relative < 1e-2, (config, relative)
        else:
            assert relative <= 1e-5, (config, relative)
        np.testing.assert_allclose(result["accuracy"], results["ring"]["accuracy"],
                                   rtol=0.05)


@pytest.mark.multiworker
def test_fit_by_default_tunes_ring_against_hierarchical_and_two_thresholds_on_nodes_of_2_and_1(
        fit_runs):
    results = fit_runs[3].results
    for result in results:
        assert result["nodes"] == [[0, 1], [2]]
        assert result["algorithms"]["default"] == "auto"

    def gradients(result):  # the gradients' all-reduce: 2 buckets at 256 bytes, 3 at 64
        (plan,) = [p for p in result["autotune"]["default"]
                   if p["fusion_thresholds"] == [256, 64]]
        return plan

    # The two algorithms that differ here (2d needs equal nodes) at both
    # thresholds, each timed in the candidates' trial steps (12), then each
    # bucket's fastest together (4), then one threshold and one choice per
    # bucket in the 17th step, the same on every worker; the last 2 of 19
    # steps ran the choice traced again as a fixed plan (the count stops).
    plan = gradients(results[0])
    assert sorted(plan["candidates"]) == ["hierarchical", "ring"]
    assert plan["steps"] == 17 and plan["retraced"]
    assert len(plan["choices"]) == {256: 2, 64: 3}[plan["fusion_threshold_bytes"]]
    for result in results:
        assert np.all(np.asarray(gradients(result)["seconds"]) > 0)
        assert np.all(np.asarray(gradients(result)["span_seconds"]) > 0)
        assert np.all(np.asarray(gradients(result)["mix_span_seconds"]) > 0)
        assert gradients(result)["choices"] == plan["choices"]
        assert gradients(result)["fusion_threshold_bytes"] == plan["fusion_threshold_bytes"]


@pytest.mark.multiworker
def test_fit_hybrid_uses_both_algorithms_and_the_chief_logs_it(fit_runs):
    plans = fit_runs[4].results[0]["plans"]
    assert plans["hybrid"] == ["hierarchical", "ring"]
    assert plans["2d"] == ["2d", "2d"]
    output = fit_runs[4].output.splitlines()
    assert not [l for l in output if not l.startswith("[worker 0]") and (
        "tfscale.Strategy: " in l or "tfscale all-reduce of" in l)]
    # The chief's own lines: other workers' output may interleave.
    lines = [l for l in output if l.startswith("[worker 0]")]
    strategies = [l for l in lines if "tfscale.Strategy: " in l]
    # One Strategy per configuration, each with the options it was given.
    assert len(strategies) == len(FIT_CONFIGS[4])
    for line, config in zip(strategies, FIT_CONFIGS[4], strict=True):
        algorithm, _, compression = config.partition("+")
        assert ("4 workers in 2 nodes of 2; CommunicationOptions("
                f"algorithm={algorithm!r}, fusion_threshold_bytes=256, ") in line
        assert f"compression={compression or None!r}" in line
        assert "local_size=2" in line
    gradients = [i for i, l in enumerate(lines)
                 if "tfscale all-reduce of 4 tensor(s)" in l and "algorithm=hybrid" in l]
    assert len(gradients) == 1
    assert "hybrid threshold 400 bytes (given)" in lines[gradients[0]]
    assert lines[gradients[0] + 1:gradients[0] + 3] == [
        "[worker 0]   bucket 0: 2 tensor(s), 272 bytes float32: hierarchical",
        "[worker 0]   bucket 1: 2 tensor(s), 576 bytes float32: ring",
    ]


# ---------------------------------------------------------------- overlap


@pytest.mark.multiworker
def test_bucket_all_reduces_overlap_backprop(tmp_path):
    """Tensor fusion's point, timed inside the step: the first bucket (the
    last layers) is summed while backprop is still producing the gradients of
    the first layers. Buckets in forward order, or one wait for every gradient
    before any all-reduce, would leave no gap (see the worker's docstring).

    A worker that runs ahead waits for its peer's first bucket, so in each
    step the worker that came last (the larger gap) is the one to judge; on
    2 busy cores the collective's threads can also be starved until backprop
    ends, so some steps show no gap either way. Without overlap every gap is
    about 0 (the two timestamps run back to back)."""
    run = run_workers("collectives_overlap.py", 2, tmp_path, timeout=180)
    assert_succeeded(run)
    per_worker = []
    for result in run.results:
        assert len(result["buckets"]) >= 6  # 4 MiB buckets of 4 MiB kernels
        gaps = result["first_sum_before_last_gradient_ms"][1:]  # after tracing
        print(f"worker {result['worker_index']}: first bucket summed this many ms "
              f"before the last gradient, per step: {[round(g, 1) for g in gaps]}")
        per_worker.append(gaps)
    overlapped = [max(step) for step in zip(*per_worker, strict=True) if max(step) > 20.0]
    assert len(overlapped) >= 2, per_worker


# ---------------------------------------------------------------- halving-doubling
# Last in this module: its 5 workers would otherwise replace the pools of 4
# and 3 (tests/worker_pool.py keeps 3) that the fit runs above reuse.

# Workers -> workers per node, for the halving-doubling runs. 3 and 4 workers
# (nodes of 2) sum exactly in the all-reduce runs above (odd, chunked
# buffers); 3 train alike in the fit runs above; 9 (8 in three rounds, one
# folded in) train as one worker in tests/test_scale.py, where network
# namespaces can be made.
HALVING_DOUBLING_RUNS = {2: 1, 5: 2}


@pytest.mark.multiworker
@pytest.mark.parametrize("num_workers", list(HALVING_DOUBLING_RUNS))
def test_halving_doubling_sums_exactly_and_alike_on_any_number_of_workers(
        tmp_path, num_workers):
    """2: one round, one worker a node; 5 folds one worker into a partner. Buffers
    of 1, n - 1, 7, 15 and 1001 elements (padded to a multiple of the
    power of two), through `ReplicaContext.all_reduce` as Keras calls it."""
    run = run_workers("collectives_halving_doubling.py", num_workers, tmp_path,
                      args=[f"--local_size={HALVING_DOUBLING_RUNS[num_workers]}"],
                      timeout=180)
    assert_succeeded(run)
    results = run.results
    schedule = topology.halving_doubling(num_workers)
    expected = _sum64(results, "integer_inputs")
    real = _sum64(results, "real_inputs")
    bound = [num_workers * F32_U * a for a in _abs_sum64(results, "real_inputs")]
    bfloat16 = np.sum([r["bfloat16_input"] for r in results], axis=0)
    for result in results:
        fold_partner, _, steps = schedule.role(result["worker_index"])
        partners = {p for p, _ in steps} | ({fold_partner} - {None})
        assert result["partners"] == sorted(partners)
        # Every tensor its own buffer, each by halving-doubling: 6 integer-
        # valued tensors, then 5 real ones, through tfscale's all-reduce.
        assert [a for a, _ in result["plan"]] == ["halving_doubling"] * 6
        assert result["routed"] == [6, 5]
        for got, want in zip(result["integer"], expected, strict=True):
            np.testing.assert_array_equal(got, want)
        for got, want, b in zip(result["real"], real, bound, strict=True):
            assert np.all(np.abs(np.asarray(got) - want) <= b)
        # Each element is summed on one worker and copied: the same bits.
        assert result["real"] == results[0]["real"]
        np.testing.assert_array_equal(result["bfloat16"], bfloat16)
