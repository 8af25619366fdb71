"""launch/bench/stats.py: sizes, rates, link bounds, exact inputs and checks."""

import numpy as np
import pytest

from tfscale.launch.bench import stats


def test_sizes_and_rates_parse_as_nccl_tests_and_tc_read_them():
    assert stats.parse_sizes(["64KB", "4MB", "1GB", "1024"]) == [
        65536, 4 * 1024**2, 1024**3, 1024]
    assert stats.parse_rate("200mbit") == 25e6
    assert stats.parse_rate("1gbit") == 125e6
    assert stats.parse_rate("3mbps") == 3e6  # tc: bps = bytes per second
    with pytest.raises(ValueError, match=r"Received: '3 parsecs'"):
        stats.parse_size("3 parsecs")
    with pytest.raises(ValueError, match=r"multiple of 4 bytes.*'6'"):
        stats.parse_sizes(["6"])
    with pytest.raises(ValueError, match=r"tc unit.*'fast'"):
        stats.parse_rate("fast")


def test_link_bound_is_the_bytes_each_node_link_must_carry_over_its_rate():
    # Two nodes: S bytes each way, S / R.
    assert stats.link_bound_seconds(100e6, 2, 25e6) == pytest.approx(4.0)
    # m nodes: 2(m-1)/m S / R.
    assert stats.link_bound_seconds(100e6, 4, 25e6) == pytest.approx(6.0)
    assert stats.link_bound_seconds(100e6, 1, 25e6) is None
    assert stats.link_bound_seconds(100e6, 2, None) is None
    assert stats.bus_factor(4) == 1.5
    assert stats.node_sizes(4, local_size=2) == [2, 2]
    assert stats.node_sizes(3, local_size=2) == [2, 1]
    assert stats.node_sizes(4, emulate_nodes=2) == [2, 2]
    assert stats.node_sizes(4) == [4]


def test_inputs_sum_exactly_even_in_16_bits():
    shapes = [[5, 3], [1000]]
    expected = stats.expected_sum(shapes, 4)
    reference = sum(np.concatenate([a.ravel() for a in stats.integer_inputs(shapes, r)])
                    .astype(np.float64) for r in range(4))
    assert np.array_equal(np.concatenate([e.ravel() for e in expected]), reference)
    # Every partial sum is an integer of magnitude <= 128: exact in bfloat16.
    assert max(np.abs(e).max() for e in expected) <= 16
    # Ranks differ, so a local copy is not the sum.
    first = stats.integer_inputs(shapes, 0)
    assert stats.count_wrong(first, expected) > 0


def test_the_correctness_check_rejects_a_corrupted_sum():
    shapes = [[4, 4], [10]]
    expected = stats.expected_sum(shapes, 2)
    assert stats.count_wrong([e.copy() for e in expected], expected) == 0
    corrupted = [e.copy() for e in expected]
    corrupted[1][3] += 1.0  # one element off by one
    assert stats.count_wrong(corrupted, expected) == 1
    rounded = [e.copy() for e in expected]
    rounded[0] = rounded[0] + 1e-3  # off by a rounding error everywhere
    assert stats.count_wrong(rounded, expected) == 16
    assert stats.count_wrong(expected[:1], expected) == 10  # a missing tensor
    assert stats.count_wrong([expected[0].ravel(), expected[1]], expected) == 16


def test_the_slowest_worker_of_each_repeat_counts():
    median, maxima = stats.median_of_max([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]])
    assert maxima == [3.0, 5.0, 2.5] and median == 3.0
    with pytest.raises(ValueError, match="same, non-zero number of repeats"):
        stats.median_of_max([[1.0], [1.0, 2.0]])


def test_the_cluster_is_described_with_its_nodes_and_link():
    loopback = {"num_workers": 2, "node_sizes": [2], "emulate_nodes": None}
    assert stats.describe_cluster(loopback) == (
        "2 workers in 1 node(s) of 2; loopback (127.0.0.1), no rate limit")
    emulated = {"num_workers": 4, "node_sizes": [2, 2], "emulate_nodes": 2,
                "inter_node_rate": "200mbit", "link_rate": 25e6}
    assert stats.describe_cluster(emulated) == (
        "4 workers in 2 node(s) of 2; emulated nodes (network namespaces), "
        "inter-node link tbf 200mbit = 25.0 MB/s per direction")
    uneven = {"num_workers": 3, "node_sizes": [2, 1], "emulate_nodes": None}
    assert stats.describe_cluster(uneven).startswith("3 workers in nodes of sizes [2, 1]")


def test_the_train_header_gives_the_gradients_and_their_link_bound():
    from tfscale.launch.bench import train
    # AlexNet-BN at 224 x 224 on 2 nodes joined by 200 Mbit/s (not the
    # 227 x 227 model, whose gradients are 249.5 MB).
    line = train.gradients_line(50_845_896, {"node_sizes": [2, 2], "link_rate": 25e6})
    assert line == ("# gradients: 50,845,896 trainable parameters = 203.4 MB in float32 "
                    "(MB = 1e6 bytes) per step; link bound 8135 ms per step with float32 "
                    "on the wire, 4068 ms in 16 bits")
    # One node, or no rate: no bound.
    assert train.gradients_line(1000, {"node_sizes": [4], "link_rate": None}) == (
        "# gradients: 1,000 trainable parameters = 0.0 MB in float32 (MB = 1e6 bytes) "
        "per step")
