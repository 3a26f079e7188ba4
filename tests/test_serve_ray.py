"""Ray Serve: a local Ray instance, 2 engine replicas of the tiny model behind one endpoint, driven
by the official `openai` client with concurrent requests; both replicas must serve. One Ray session
for the module (Ray starts slowly). Ray is a test dependency: no skip when it is missing."""
from __future__ import annotations

import json
import os
import socket
import threading
import urllib.request

import pytest
from test_serve import MSGS, pipe  # noqa: F401 - the module-scoped tiny Pipeline fixture

import mixqrt
from mixqrt.platform.topology import Node, Topology
from mixqrt.serving.server.guard import Limits
from mixqrt.serving.server.ray import core_sets


def test_core_sets():
    one = Topology(nodes=[Node(0, (0, 1, 2, 3), 0)], online_cpus=(0, 1, 2, 3))
    assert core_sets(2, one, allowed=[0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert core_sets(3, one, allowed=[0, 1, 2, 3]) == [(0,), (1,), (2,)]
    assert core_sets(3, one, allowed=[0, 1]) == [(0,), (1,), (0,)]
    two = Topology(nodes=[Node(0, (0, 1), 0), Node(1, (2, 3), 0)], online_cpus=(0, 1, 2, 3))
    assert core_sets(2, two, allowed=[0, 1, 2, 3]) == [(0, 1), (2, 3)]      # a NUMA node each
    assert core_sets(1, two, allowed=[0, 1, 2, 3]) == [(0, 1)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_url(pipe):  # noqa: F811
    import ray
    from ray import serve

    from mixqrt.serving.server.ray import build
    port = _free_port()
    # Ray puts the driver's working directory on its workers' sys.path: start it where the imported
    # mixqrt lives, so replicas import that one (CI installs it into a venv; the clone has no
    # built extensions)
    here = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(mixqrt.__file__))))
    try:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    finally:
        os.chdir(here)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build(pipe.path, model_name="tiny", limits=Limits(), replicas=2, cpus_per_replica=1,
                    engine_kwargs={"max_slots": 4, "max_queue": 16, "threads": 1}, max_context=256)
        serve.run(app, name="mixqrt", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_behind_one_endpoint(ray_url):
    from openai import OpenAI
    client = OpenAI(base_url=ray_url + "/v1", api_key="none", max_retries=2)
    seen, texts, lock = set(), set(), threading.Lock()

    def one(i):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MSGS, max_tokens=4,
                                                               temperature=0)
        out = raw.parse()
        with lock:
            seen.add(raw.headers["x-mixqrt-replica"])
            texts.add(out.choices[0].message.content)

    for _ in range(6):                                   # bounded: the router spreads concurrent load
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if len(seen) >= 2:
            break
    assert len(seen) == 2, seen
    assert len(texts) == 1                              # same weights, greedy: same answer everywhere
    chunks = list(client.completions.create(model="tiny", prompt="def f(x):", max_tokens=4, temperature=0,
                                            stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    health = {json.loads(urllib.request.urlopen(ray_url + "/health", timeout=30).read())["cpus"]
              for _ in range(12)}
    assert health                                       # each replica reports the CPUs it is pinned to


def _tree(root: int) -> set[int]:
    """root and every process descended from it (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += kids.get(p, [])
    return out


def _listening(pids) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that `pids` hold open."""
    inodes = set()
    for p in pids:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                link = os.readlink(f"/proc/{p}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    out.append(cols[1])
    return out


def _loopback(hex_addr: str) -> bool:
    """/proc/net/tcp{,6} local address (hex, 32-bit words little-endian) on 127/8, ::1 or ::ffff:127/104."""
    ip = hex_addr.split(":")[0].upper()
    if len(ip) == 8:                                     # 0100007F = 127.0.0.1
        return ip.endswith("7F")
    return ip == "00000000000000000000000001000000" or (ip[:24] == "0000000000000000FFFF0000" and ip.endswith("7F"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ray_on_loopback_listens_on_loopback_and_sigterm_leaves_no_ray_process(pipe, tmp_path):  # noqa: F811
    """`mixqrt serve --ray --host 127.0.0.1`: every port of the server's own Ray processes is on
    loopback, and after SIGTERM none of them is left."""
    import signal
    import subprocess
    import sys
    import time
    parent = os.path.dirname(os.path.dirname(os.path.abspath(mixqrt.__file__)))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = parent
    code = "import sys; from mixqrt.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.Popen([sys.executable, "-c", code, "serve", str(pipe.path), "--ray", "--replicas", "1", "-t", "1",
                          "--host", "127.0.0.1", "--port", str(port), "-q"], cwd=parent, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ours: set[int] = set()
    try:
        deadline, up = time.monotonic() + 240, False
        while time.monotonic() < deadline and p.poll() is None and not up:
            try:
                up = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
            except OSError:
                time.sleep(1)
        assert up, p.stderr.read().decode()[-3000:] if p.poll() is not None else "no /health within 240 s"
        ours = _tree(p.pid)
        listening = _listening(ours)
        assert listening and not [a for a in listening if not _loopback(a)], listening
        p.send_signal(signal.SIGTERM)
        p.wait(120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(q) for q in ours):
            time.sleep(0.5)
        left = [q for q in ours if _alive(q)]
        assert not left, [open(f"/proc/{q}/cmdline").read().replace("\0", " ")[:200] for q in left if _alive(q)]
        assert p.returncode == 143
    finally:
        for q in (ours | _tree(p.pid)) if p.poll() is None else ours:   # a failed run cleans up after itself
            if _alive(q):
                try:
                    os.kill(q, signal.SIGKILL)
                except OSError:
                    pass
