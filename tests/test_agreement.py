"""tfscale.agreement: how differing settings are reported."""

from tfscale import agreement


def test_differences_name_each_setting_and_the_workers():
    lines = agreement.differences([
        {"global_batch_size": 64, "model": "resnet50", "seed": 0},
        {"global_batch_size": 128, "model": "resnet50", "seed": 0},
        {"global_batch_size": 64, "model": "resnet50"},
    ])
    assert lines == [
        "global_batch_size: 64 on workers 0, 2, 128 on worker 1",
        "seed: 0 on workers 0, 1, <unset> on worker 2",
    ]


def test_equal_settings_have_no_differences():
    same = {"a": [1, 2], "b": "x"}
    assert agreement.differences([same, dict(same)]) == []
