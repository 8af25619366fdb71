"""A CPU worker's distributed datasets are read on its host with a plain
iterator (tfscale._private.host_input), with the batches TensorFlow's
MultiDeviceIterator gives; options the user passes are TensorFlow's to honour.
On more workers the whole suite trains through it (tests/test_uneven_data.py:
every worker's share of uneven and partial batches, fit, evaluate and
predict against one worker)."""

import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale._private import host_input


@pytest.fixture(scope="module")
def strategy():
    return tfscale.Strategy()


def _dataset():
    # 10 examples in batches of 4: the last batch is partial.
    x = np.arange(20, dtype="float32").reshape(10, 2)
    return tf.data.Dataset.from_tensor_slices((x, np.arange(10))).batch(4)


def _batches(distributed):
    return [[t.numpy().tolist() for t in tf.nest.flatten(batch)] for batch in distributed]


@pytest.mark.parametrize("distribute", ["experimental_distribute_dataset",
                                        "distribute_datasets_from_function"])
def test_without_options_a_cpu_worker_reads_on_its_host_the_same_batches(strategy, distribute):
    def make(options=None):
        if distribute == "experimental_distribute_dataset":
            return strategy.experimental_distribute_dataset(_dataset(), options=options)
        return strategy.distribute_datasets_from_function(lambda _: _dataset(),
                                                          options=options)

    assert host_input.reads_on_host(iter(make()))
    # The user's options go to TensorFlow as given: its MultiDeviceIterator.
    assert not host_input.reads_on_host(iter(make(tf.distribute.InputOptions())))
    assert _batches(make()) == _batches(make(tf.distribute.InputOptions()))
    assert [len(b[1]) for b in _batches(make())] == [4, 4, 2]


def test_a_host_iterator_passed_into_a_tf_function_keeps_reading_on_the_host(strategy):
    # Keras's train function takes the iterator as an argument, as here.
    iterator = iter(strategy.experimental_distribute_dataset(_dataset()))

    @tf.function
    def step(iterator):
        x, y = next(iterator)
        return strategy.reduce("SUM", strategy.run(tf.reduce_sum, args=(y,)), axis=None)

    assert [int(step(iterator)) for _ in range(3)] == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9]
    assert host_input.reads_on_host(iterator)


def test_fit_evaluate_and_predict_distribute_their_data_through_the_strategy_without_options(
        strategy):
    import keras

    x = np.random.default_rng(0).normal(size=(12, 2)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    made = []
    original = strategy.experimental_distribute_dataset

    def distribute(dataset, options=None):
        distributed = original(dataset, options=options)
        made.append((options, host_input.reads_on_host(iter(distributed))))
        return distributed

    strategy.experimental_distribute_dataset = distribute
    try:
        model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0)
        model.evaluate(x, x[:, :1], batch_size=4, verbose=0)
        model.predict(x, batch_size=4, verbose=0)
    finally:
        del strategy.experimental_distribute_dataset
    # Each call's data, without options: read on the host.
    assert made == [(None, True)] * 3
