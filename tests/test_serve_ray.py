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
from mixqrt.serve.guard import Limits
from mixqrt.serve.ray import core_sets


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

    from mixqrt.serve.ray import build
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
