"""A worker for the emulated-node tests: measures TCP throughput between workers.

    netns_probe.py SRC>DST:BYTES [SRC>DST:BYTES ...]

Every worker listens on its own TF_CONFIG address (so this also shows the
address is local to the worker's namespace and reachable from the others),
sends BYTES to DST for each pair it is SRC of, one pair after another, and
reports for each: seconds from connect until DST acknowledged the last byte,
and bits/second. No TensorFlow.
"""

import json
import os
import socket
import sys
import threading
import time

from report import report

CHUNK = 64 * 1024
DEADLINE = time.monotonic() + 60

config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
addresses = config["cluster"]["worker"]
host, port = addresses[index].rsplit(":", 1)
pairs = []
for arg in sys.argv[1:]:
    route, size = arg.split(":")
    src, dst = route.split(">")
    pairs.append((int(src), int(dst), int(size)))
print(f"pid={os.getpid()} tf_config={json.dumps(config)}", flush=True)

listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind((host, int(port)))  # fails unless host is this namespace's address
listener.listen(len(addresses))
incoming = sum(1 for _, dst, _ in pairs if dst == index)


def receive(connection):
    with connection:
        while connection.recv(1 << 20):
            pass
        connection.sendall(b"!")  # everything arrived


def serve():
    threads = []
    for _ in range(incoming):
        connection, _ = listener.accept()
        thread = threading.Thread(target=receive, args=(connection,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


server = threading.Thread(target=serve)
server.start()


def send(dst, size):
    dst_host, dst_port = addresses[dst].rsplit(":", 1)
    payload = b"\0" * CHUNK
    while True:  # the receiver may not be listening yet
        try:
            start = time.monotonic()
            sock = socket.create_connection((dst_host, int(dst_port)), timeout=30)
            break
        except (ConnectionRefusedError, socket.timeout):
            if time.monotonic() > DEADLINE:
                raise
            time.sleep(0.05)
    with sock:
        left = size
        while left:
            left -= sock.send(payload[:min(left, CHUNK)])
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b"!"
        seconds = time.monotonic() - start
    return {"src": index, "dst": dst, "bytes": size, "seconds": seconds,
            "bits_per_second": size * 8 / seconds}


sent = [send(dst, size) for src, dst, size in pairs if src == index]
for row in sent:
    print(f"sent {row['bytes']} bytes to worker {row['dst']} in "
          f"{row['seconds']:.3f} s: {row['bits_per_second'] / 1e6:.1f} Mbit/s", flush=True)
server.join()
report({"index": index, "host": host, "netns": os.readlink("/proc/self/ns/net"),
        "sent": sent})
