"""A worker for the isolation tests: builds `tfscale.Strategy` (so TensorFlow's
gRPC server listens on its TF_CONFIG port), reports its address and network
namespace, then keeps listening until the test creates `release` in the
results directory (at most 120 s)."""

import json
import os

import tfscale
from report import report
from report import wait_for_file

config = json.loads(os.environ["TF_CONFIG"])
strategy = tfscale.Strategy()
report({
    "address": config["cluster"]["worker"][config["task"]["index"]],
    "num_workers": strategy.num_workers,
    "netns": os.readlink("/proc/self/ns/net"),
})
release = os.path.join(os.environ["TFSCALE_TEST_RESULTS"], "release")
wait_for_file(release, 120)
