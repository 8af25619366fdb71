"""A worker whose peer has not started: it says whom it waits for, gives up
after --startup_timeout, stops at SIGTERM/SIGINT, and trains once the peer
comes (tfscale.startup).

The tfscale-train tests start their processes themselves with a 2-worker
TF_CONFIG, without the launcher (which would stop the lone worker for it).
"""

import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from multiworker import worker_env

TRAIN = [sys.executable, "-m", "tfscale.launch.train", "--model=alexnet_bn_small", "--fc_units=16",
         "--global_batch_size=24", "--epochs=1", "--steps_per_epoch=2",
         "--export_dir=export", "--collective_timeout=120"]
STARTUP_TIMEOUT = 12  # seconds: reports every quarter of it, 3 s


def tf_config(addresses, index):
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


def start_worker(tmp_path, addresses, index, *flags):
    """Starts tfscale-train as worker `index`; its output goes to a log file."""
    log_path = tmp_path / f"worker-{index}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*TRAIN, *flags], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
            env=worker_env(tmp_path, {"TF_CONFIG": tf_config(addresses, index)}),
            start_new_session=True,
            # Ctrl-C's default, whatever this process inherited.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return process, log_path


def two_addresses():
    from tfscale.launch import ports

    return [f"127.0.0.1:{port}" for port in ports.free_ports("127.0.0.1", 2)]


def wait_for_text(log_path, text, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if text in log_path.read_text():
            return
        time.sleep(0.1)
    pytest.fail(f"no {text!r} after {seconds} s:\n{log_path.read_text()[-3000:]}")


def listening(address):
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def cleanup():
    processes = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_names_missing_tasks_as_tfscale_names_them_with_a_chief_job():
    from tfscale.launch import ports
    from tfscale import startup

    addresses = [f"127.0.0.1:{port}" for port in ports.free_ports("127.0.0.1", 4)]
    cluster = {"chief": [addresses[0]], "worker": addresses[1:3], "evaluator": [addresses[3]]}
    host, port = addresses[1].rsplit(":", 1)
    with socket.create_server((host, int(port))):  # worker 0 has started
        start = time.monotonic()
        with pytest.raises(startup.StartupError) as raised:
            startup.wait_for_peers(cluster, "chief", 0, timeout_seconds=1)
    assert 1 <= time.monotonic() - start < 5
    # The evaluator does not train: nobody waits for it.
    assert raised.value.missing == [f"worker 1 ({addresses[2]})"]
    assert raised.value.signum is None
    assert str(raised.value).startswith(
        f"gave up after 1 s waiting for worker 1 ({addresses[2]}) to start: it never")
    assert not listening(addresses[0])  # the chief's listener is closed again
    # Tasks that do not train start at once.
    startup.wait_for_peers(cluster, "evaluator", 0, timeout_seconds=1)


def test_startup_timeout_must_be_positive():
    import tfscale

    with pytest.raises(ValueError, match=r"Argument `startup_timeout_seconds` must "
                       r"be a number > 0, or None to wait as long as it takes. "
                       r"Received: startup_timeout_seconds=0"):
        tfscale.Strategy(startup_timeout_seconds=0)


@pytest.mark.multiworker
def test_gives_up_after_the_startup_timeout_naming_the_missing_worker(
        tmp_path, cleanup):
    addresses = two_addresses()
    process, log_path = start_worker(tmp_path, addresses, 0,
                                     f"--startup_timeout={STARTUP_TIMEOUT}")
    cleanup.append(process)
    process.wait(timeout=120)
    output = log_path.read_text()
    waiting = f"tfscale: waiting for worker 1 ({addresses[1]}) to start ("
    reports = [int(s) for s in re.findall(re.escape(waiting) + r"(\d+) s so far", output)]
    # The first report at once, then every 3 s (the quarter of 12 s).
    assert len(reports) >= 3 and reports[0] == 0 and reports[-1] >= 6, output[-3000:]
    assert process.returncode == 1, output[-3000:]
    assert (f"tfscale-train: gave up after {STARTUP_TIMEOUT} s waiting for worker 1 "
            f"({addresses[1]}) to start: it never accepted a connection. Start it, "
            "or check the cluster's addresses (TF_CONFIG). --startup_timeout sets "
            "this limit.") in output, output[-3000:]
    assert "Traceback" not in output
    assert not listening(addresses[0])


@pytest.mark.multiworker
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_stops_the_waiting_worker_within_seconds(tmp_path, cleanup, signum):
    addresses = two_addresses()
    process, log_path = start_worker(tmp_path, addresses, 0)  # default timeout
    cleanup.append(process)
    wait_for_text(log_path, f"waiting for worker 1 ({addresses[1]})", 120)
    assert listening(addresses[0])  # worker 0 shows its peers it has started
    process.send_signal(signum)
    sent = time.monotonic()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 10 s after {signum.name}:\n{log_path.read_text()[-3000:]}")
    print(f"{signum.name}: exited {time.monotonic() - sent:.2f} s after the signal")
    output = log_path.read_text()
    assert process.returncode == 128 + signum, output[-3000:]
    assert (f"tfscale-train: stopped by {signum.name} while waiting for worker 1 "
            f"({addresses[1]}) to start.") in output, output[-3000:]
    assert not listening(addresses[0])


@pytest.mark.multiworker
def test_a_worker_that_starts_late_but_in_time_trains_with_the_other(
        tmp_path, cleanup):
    addresses = two_addresses()
    first, first_log = start_worker(tmp_path, addresses, 0)
    cleanup.append(first)
    wait_for_text(first_log, f"waiting for worker 1 ({addresses[1]})", 120)
    second, second_log = start_worker(tmp_path, addresses, 1)
    cleanup.append(second)
    for process, log_path in ((first, first_log), (second, second_log)):
        process.wait(timeout=240)
        assert process.returncode == 0, log_path.read_text()[-3000:]
    assert "Exported SavedModel to" in first_log.read_text()
