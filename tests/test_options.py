"""tfscale.CommunicationOptions and PowerSGDOptions (collectives/options.py):
defaults, validation, config round trip."""

import dataclasses
import re

import pytest
import tensorflow as tf

import tfscale
from tfscale.collectives import cost_model

Options = tfscale.CommunicationOptions
PowerSGD = tfscale.PowerSGDOptions


def test_defaults():
    assert Options().get_config() == {
        "algorithm": None,
        "fusion_threshold_bytes": 32 * 1024 * 1024,
        "hybrid_threshold_bytes": None,
        "local_size": None,
        "compression": None,
        "timeout_seconds": 300,
        "cost_model": None,
        "time_all_reduces": True,
        "powersgd": None,
        "implementation": "auto",
        "timeline": None,
        "autotune_dir": None,
    }


def test_every_algorithm_and_compression_is_accepted():
    for algorithm in ("ring", "hierarchical", "2d", "halving_doubling", "hybrid", "auto"):
        assert Options(algorithm=algorithm).algorithm == algorithm
    for compression in (None, "bfloat16", "float16", "powersgd"):
        assert Options(compression=compression).compression == compression
    for implementation in ("auto", "ring"):
        assert Options(implementation=implementation).implementation == implementation


def test_powersgd_defaults_follow_pytorch_and_can_be_set():
    assert Options(compression="powersgd").powersgd == PowerSGD(
        rank=4, start_step=10, min_compression_rate=2.0)
    options = Options(compression="powersgd",
                      powersgd=PowerSGD(rank=1, start_step=0, min_compression_rate=1))
    assert options.powersgd.get_config() == {
        "rank": 1, "start_step": 0, "min_compression_rate": 1.0, "bucket_bytes": None}
    assert Options.from_config(options.get_config()) == options


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().algorithm = "ring"
    with pytest.raises(dataclasses.FrozenInstanceError):
        PowerSGD().rank = 2


@pytest.mark.parametrize("kwargs,message", [
    ({"algorithm": "tree"},
     "Argument `algorithm` must be None or one of ['ring', 'hierarchical', '2d', "
     "'halving_doubling', 'hybrid', 'auto']. Received: algorithm='tree'"),
    ({"fusion_threshold_bytes": -1},
     "Argument `fusion_threshold_bytes` must be an integer >= 0. "
     "Received: fusion_threshold_bytes=-1"),
    ({"fusion_threshold_bytes": 1.5e6},
     "Argument `fusion_threshold_bytes` must be an integer >= 0. "
     "Received: fusion_threshold_bytes=1500000.0"),
    ({"hybrid_threshold_bytes": -5},
     "Argument `hybrid_threshold_bytes` must be an integer >= 0, or None to take "
     "it from the cost model. Received: hybrid_threshold_bytes=-5"),
    ({"algorithm": "ring", "hybrid_threshold_bytes": 1024},
     "Argument `hybrid_threshold_bytes` only applies to algorithm='hybrid'; this "
     "is algorithm='ring'. Received: hybrid_threshold_bytes=1024"),
    ({"local_size": 0},
     "Argument `local_size` must be an integer >= 1 (workers per node), or None "
     "to group workers by host. Received: local_size=0"),
    ({"local_size": True},
     "Received: local_size=True"),
    ({"compression": "int8"},
     "Argument `compression` must be None or one of ['bfloat16', 'float16', "
     "'powersgd']. Received: compression='int8'"),
    ({"compression": "bfloat16", "powersgd": PowerSGD(rank=2)},
     "Argument `powersgd` only applies to compression='powersgd'; this is "
     "compression='bfloat16'. Received: powersgd=PowerSGDOptions(rank=2, "
     "start_step=10, min_compression_rate=2.0, bucket_bytes=None)"),
    ({"implementation": "NCCL"},
     "Argument `implementation` must be one of ['auto', 'ring', 'nccl']. "
     "Received: implementation='NCCL'"),
    ({"timeout_seconds": 0},
     "Argument `timeout_seconds` must be a number > 0, or None to wait forever. "
     "Received: timeout_seconds=0"),
])
def test_bad_values_name_the_argument_and_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Options(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"rank": 0}, "Argument `rank` must be an integer >= 1 (the rank of the "
     "factors). Received: rank=0"),
    ({"start_step": -1}, "Argument `start_step` must be an integer >= 0 "
     "(optimizer updates all-reduced uncompressed before PowerSGD starts). "
     "Received: start_step=-1"),
    ({"min_compression_rate": 0.5}, "Argument `min_compression_rate` must be a "
     "number >= 1 (a matrix is compressed only if it shrinks at least this many "
     "times). Received: min_compression_rate=0.5"),
])
def test_bad_powersgd_values_name_the_argument_and_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PowerSGD(**kwargs)


def test_cost_model_must_be_a_cost_model():
    with pytest.raises(TypeError, match=re.escape(
            "Argument `cost_model` must be a `tfscale.collectives.cost_model.CostModel` "
            "or None. Received: cost_model={'intra': 1}")):
        Options(cost_model={"intra": 1})


def test_config_round_trip():
    model = cost_model.CostModel(intra=cost_model.Link(1e-5, 1e-9),
                                 inter=cost_model.Link(1e-4, 1e-8))
    options = Options(algorithm="hybrid", fusion_threshold_bytes=4096,
                      hybrid_threshold_bytes=1 << 20, local_size=8,
                      compression="bfloat16", timeout_seconds=None,
                      cost_model=model, time_all_reduces=False,
                      implementation="ring")
    restored = Options.from_config(options.get_config())
    assert restored == options
    assert restored.cost_model == model
    assert Options.from_config(Options().get_config()) == Options()


def test_repr_shows_every_argument():
    assert repr(Options(algorithm="2d", local_size=2)) == (
        "CommunicationOptions(algorithm='2d', fusion_threshold_bytes=33554432, "
        "hybrid_threshold_bytes=None, local_size=2, compression=None, "
        "timeout_seconds=300.0, cost_model=None, time_all_reduces=True, "
        "powersgd=None, implementation='auto', timeline=None, autotune_dir=None)")


def test_time_all_reduces_must_be_a_bool():
    with pytest.raises(TypeError, match=re.escape(
            "Argument `time_all_reduces` must be True or False. "
            "Received: time_all_reduces=1")):
        Options(time_all_reduces=1)


def test_nccl_is_refused_on_a_machine_without_gpus():
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has GPUs: implementation='nccl' is accepted here")
    with pytest.raises(ValueError, match=re.escape(
            "implementation='nccl' needs GPUs, and TensorFlow sees none on this "
            "machine (tf.config.list_physical_devices('GPU') is empty; "
            "tensorflow-cpu has no NCCL). Use implementation='auto' (NCCL on "
            "GPUs, ring elsewhere) or 'ring'. Received: implementation='nccl'")):
        Options(implementation="nccl")


def test_timeline_needs_the_collective_timeout():
    with pytest.raises(ValueError, match="Argument `timeline` needs the flight recorder"):
        Options(timeline="t", timeout_seconds=None)
    with pytest.raises(TypeError, match="Argument `timeline` must be None or a directory"):
        Options(timeline=3)
    assert Options(timeline="t").get_config()["timeline"] == "t"
