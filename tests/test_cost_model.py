"""tfscale.collectives.cost_model: alpha-beta predictions, threshold, fit."""

import math
import re

import numpy as np
import pytest

from tfscale.collectives import cost_model
from tfscale.collectives.cost_model import CostModel
from tfscale.collectives.cost_model import Link

# Round numbers so that the expected times can be written by hand.
MODEL = CostModel(intra=Link(alpha=1e-5, beta=1e-9), inter=Link(alpha=1e-4, beta=1e-8))
S = 8e6  # bytes


def test_ring_crosses_the_slow_link_2_n_minus_1_times():
    # 4 workers in 2 nodes: 6 steps of S/4 over the inter-node link.
    assert MODEL.stage_times("ring", S, (2, 2)) == pytest.approx([6 * (1e-4 + S / 4 * 1e-8)])
    # One node: the same ring over the intra-node link.
    assert MODEL.stage_times("ring", S, (4,)) == pytest.approx([6 * (1e-5 + S / 4 * 1e-9)])


def test_hierarchical_stages():
    assert MODEL.stage_times("hierarchical", S, (4, 4)) == pytest.approx([
        6 * (1e-5 + S / 4 * 1e-9),   # ring all-reduce in the node
        2 * (1e-4 + S / 2 * 1e-8),   # leaders
        2 * (1e-5 + S * 1e-9),       # broadcast tree, depth log2(4)
    ])


def test_2d_stages_and_its_need_for_equal_nodes():
    assert MODEL.stage_times("2d", S, (4, 4)) == pytest.approx([
        6 * (1e-5 + S / 4 * 1e-9),
        2 * (1e-4 + S / 2 * 1e-8),   # 4 rings of S/4 share the node's link
        3 * (1e-5 + S / 4 * 1e-9),   # all-gather
    ])
    with pytest.raises(ValueError, match=re.escape(
            "The 2d algorithm needs nodes of equal size. Received: node_sizes=[2, 1]")):
        MODEL.stage_times("2d", S, (2, 1))


@pytest.mark.parametrize("n", range(2, 10))
def test_halving_doubling_on_one_link_is_mpich_formula(n):
    # One node: 2 log2(p') alpha + 2 (p'-1)/p' S beta, plus 2 (alpha + S beta)
    # for the fold when n is not a power of two (p' = 2^floor(log2 n)).
    alpha, beta = 1e-5, 1e-9
    p = 1 << (n.bit_length() - 1)
    expected = 2 * math.log2(p) * alpha + 2 * (p - 1) / p * S * beta
    if p != n:
        expected += 2 * (alpha + S * beta)
    assert MODEL.predict("halving_doubling", S, (n,)) == pytest.approx(expected)
    assert MODEL.best_num_chunks("halving_doubling", S, (n,)) == 1


def test_halving_doubling_crosses_nodes_only_in_its_last_step():
    # 2 nodes of 4: distances 1 and 2 stay in the node (S/2, S/4); distance 4
    # sends S/8 from each of the node's 4 workers over its link, each way.
    assert MODEL.predict("halving_doubling", S, (4, 4)) == pytest.approx(
        2 * (1e-5 + S / 2 * 1e-9) + 2 * (1e-5 + S / 4 * 1e-9)
        + 2 * (1e-4 + 4 * S / 8 * 1e-8))
    # Far fewer steps than the ring's 14 over the slow link.
    assert MODEL.predict("halving_doubling", 4, (4, 4)) < MODEL.predict("ring", 4, (4, 4)) / 3


def test_flat_topologies_predict_a_ring_for_the_hierarchical_algorithms():
    for sizes in ((4,), (1, 1, 1)):
        ring = MODEL.predict("ring", S, sizes)
        assert MODEL.predict("hierarchical", S, sizes) == ring
        assert MODEL.predict("2d", S, sizes) == ring


def test_a_pipeline_takes_the_stages_once_plus_the_slowest_per_extra_chunk():
    stages = MODEL.stage_times("hierarchical", S / 8, (4, 4))
    assert MODEL.predict("hierarchical", S, (4, 4), num_chunks=8) == pytest.approx(
        sum(stages) + 7 * max(stages))
    best = MODEL.best_num_chunks("hierarchical", S, (4, 4))
    assert best > 1
    assert MODEL.predict("hierarchical", S, (4, 4)) == min(
        MODEL.predict("hierarchical", S, (4, 4), c) for c in cost_model.CHUNK_CHOICES)
    assert MODEL.best_num_chunks("ring", S, (4, 4)) == 1
    assert MODEL.best_num_chunks("hierarchical", 4, (4, 4)) == 1


def test_hybrid_threshold_is_where_the_ring_becomes_faster():
    same = CostModel(intra=Link(1e-4, 1e-9), inter=Link(1e-4, 1e-9))
    threshold = same.hybrid_threshold_bytes((2, 2))
    assert 1 < threshold < math.inf

    def ring_faster(size):
        return same.predict("ring", size, (2, 2)) <= same.predict("hierarchical", size, (2, 2))

    assert ring_faster(threshold) and not ring_faster(threshold - 1)


def test_hybrid_threshold_extremes():
    assert MODEL.hybrid_threshold_bytes((8,)) == 0  # one node: always ring
    # A slow network and a fast node: hierarchical sends fewer bytes across
    # (2(m-1)/m against 2(n-1)/n) and wins at every size.
    assert MODEL.hybrid_threshold_bytes((8, 8)) == math.inf


@pytest.mark.parametrize("op_seconds", [0.0, 2e-4])
def test_fit_recovers_the_parameters_that_made_the_measurements(op_seconds):
    sizes = (2, 2)
    truth = CostModel(MODEL.intra, MODEL.inter, op_seconds)
    rows = [(a, s, truth.predict(a, s, sizes, c), c)
            for a in ("ring", "hierarchical", "2d")
            for s in (1e3, 1e5, 1e7)
            for c in (1, 4)]
    fitted = cost_model.fit(rows, sizes)
    for got, want in [(fitted.intra, MODEL.intra), (fitted.inter, MODEL.inter)]:
        assert got.alpha == pytest.approx(want.alpha, rel=1e-3)
        assert got.beta == pytest.approx(want.beta, rel=1e-3)
    assert fitted.op_seconds == pytest.approx(op_seconds, rel=1e-3, abs=1e-9)


def test_the_fixed_cost_of_an_op_makes_the_ring_win_small_buffers():
    # With links alone, hierarchical's short steps win a 4-byte buffer on
    # 2 nodes of 4; its three ops (the ring has one) lose it once each op
    # costs what TensorFlow's do (BENCHMARKS.md, section "The fixed cost of
    # one collective").
    links_only = CostModel(cost_model.DEFAULT.intra, cost_model.DEFAULT.inter)
    assert links_only.predict("hierarchical", 4, (4, 4)) < links_only.predict("ring", 4, (4, 4))
    with_ops = cost_model.DEFAULT
    assert with_ops.predict("ring", 4, (4, 4)) < with_ops.predict("hierarchical", 4, (4, 4))
    assert with_ops.predict("ring", 4, (4, 4)) < with_ops.predict("halving_doubling", 4, (4, 4))
    # Large buffers still go hierarchical on the slow inter-node link.
    assert with_ops.predict("hierarchical", 64 << 20, (4, 4)) < with_ops.predict(
        "ring", 64 << 20, (4, 4))


def test_fit_tolerates_noise():
    sizes = (4, 4)
    rng = np.random.default_rng(0)
    rows = [(a, s, MODEL.predict(a, s, sizes, 1) * (1 + 0.05 * rng.normal()))
            for a in ("ring", "hierarchical", "2d")
            for s in np.geomspace(1e2, 1e8, 13) for _ in range(3)]
    fitted = cost_model.fit(rows, sizes)
    assert fitted.intra.beta == pytest.approx(MODEL.intra.beta, rel=0.1)
    assert fitted.inter.alpha == pytest.approx(MODEL.inter.alpha, rel=0.1)
    assert fitted.inter.beta == pytest.approx(MODEL.inter.beta, rel=0.1)


def test_fit_on_one_node_keeps_the_prior_inter_node_link():
    rows = [("ring", s, MODEL.predict("ring", s, (4,))) for s in (1e3, 1e5, 1e7)]
    fitted = cost_model.fit(rows, (4,), prior=cost_model.DEFAULT)
    assert fitted.inter == cost_model.DEFAULT.inter
    assert fitted.intra.beta == pytest.approx(MODEL.intra.beta, rel=1e-3)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match=re.escape(
            "Argument `algorithm` must be one of ['ring', 'hierarchical', '2d', "
            "'halving_doubling']. Received: algorithm='hybrid'")):
        MODEL.predict("hybrid", S, (2, 2))
    with pytest.raises(ValueError, match=re.escape(
            "Argument `node_sizes` must be a non-empty list of integers >= 1. "
            "Received: node_sizes=(2, 0)")):
        MODEL.predict("ring", S, (2, 0))
    with pytest.raises(ValueError, match=re.escape(
            "Argument `beta` must be a finite number >= 0 (seconds per byte). "
            "Received: beta=-1")):
        Link(alpha=0.0, beta=-1)
    with pytest.raises(ValueError, match=re.escape(
            "Argument `measurements` must hold rows (algorithm, size_bytes, "
            "seconds[, num_chunks]). Received: a row ('ring', 10)")):
        cost_model.fit([("ring", 10)], (2, 2))
    with pytest.raises(ValueError, match=re.escape(
            "Argument `measurements` must hold positive sizes and times. "
            "Received: a row ('ring', 10, 0.0)")):
        cost_model.fit([("ring", 10, 0.0)], (2, 2))


def test_config_round_trip():
    assert CostModel.from_config(MODEL.get_config()) == MODEL
    assert MODEL.get_config() == {"intra": {"alpha": 1e-5, "beta": 1e-9},
                                  "inter": {"alpha": 1e-4, "beta": 1e-8},
                                  "op_seconds": 0.0}
    # A model fitted before op_seconds existed loads with none.
    old = {"intra": {"alpha": 1e-5, "beta": 1e-9}, "inter": {"alpha": 1e-4, "beta": 1e-8}}
    assert CostModel.from_config(old).op_seconds == 0.0


def test_hybrid_follows_a_fitted_model_whose_crossover_runs_the_other_way():
    # Parameters fit on the emulated 2x2 cluster (docs/bench): the ring wins
    # small buffers, hierarchical wins large ones. A single "hierarchical
    # below the threshold" cut would send everything by ring.
    from tfscale import collectives
    from tfscale.collectives import topology as topology_lib

    model = cost_model.CostModel(
        intra=cost_model.Link(alpha=0.0029104346163692494, beta=3.428418420562053e-09),
        inter=cost_model.Link(alpha=0.0014266266428584898, beta=4.5121468928260926e-08),
    )
    nodes = [2, 2]
    big, small = 32 * 2**20, 4
    assert model.predict("hierarchical", big, nodes) < model.predict("ring", big, nodes)
    assert model.predict("ring", small, nodes) <= model.predict("hierarchical", small, nodes)
    topology = topology_lib.from_hosts(["a", "a", "b", "b"], rank=0)
    buckets = collectives.plan([big // 4, small // 4], ["float32", "float32"], topology,
                               "hybrid", fusion_threshold_bytes=big // 4, cost_model=model)
    assert [b.algorithm for b in buckets] == ["hierarchical", "ring"]
