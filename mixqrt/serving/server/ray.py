"""N engine replicas behind one OpenAI endpoint on Ray Serve (the `ray` extra).

    mixqrt serve MODEL --ray --replicas 2                       # local Ray, fixed replicas
    mixqrt serve MODEL --ray --min-replicas 1 --max-replicas 4  # Ray Serve autoscaling
    mixqrt serve MODEL --ray --ray-address auto                 # an existing cluster (docs/server.md)

Each replica is a Ray actor running the same ASGI app as `mixqrt serve` (mixqrt.serving.server.app) over its
own Engine. On start it takes its rank on the host (Ray Serve's local_rank) and pins the whole
process to one core set from core_sets(): a NUMA node each when the host has enough, else an equal
share of the allowed CPUs, and runs that many kernel threads. The model is quantized once by the
driver; replicas open the resulting .mxq read-only with mmap (MAP_SHARED), so replicas on one host
share one page-cache copy of the weights. Every response carries X-Mixqrt-Replica.
"""
from __future__ import annotations

import os
import socket

from mixqrt.errors import MixqrtError
from mixqrt.platform.affinity import compact_cpus
from mixqrt.platform.topology import format_cpulist, topology, usable_cpus


def core_sets(n: int, topo=None, allowed=None) -> list[tuple[int, ...]]:
    """n CPU sets, disjoint while the CPUs last: one NUMA node per replica when there are at least n
    nodes with allowed CPUs, else contiguous runs of the compact (node-filling) CPU order, in which
    a core's SMT siblings sit together (a replica gets whole cores)."""
    if n < 1:
        raise MixqrtError(f"core_sets: need at least one replica, got {n}")
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    topo = topo or topology()
    nodes = [tuple(c for c in node.cpus if c in set(allowed)) for node in topo.cpu_nodes]
    nodes = [g for g in nodes if g]
    if len(nodes) >= n:
        return nodes[:n]
    order = compact_cpus(topo, allowed)
    if len(order) < n:                  # more replicas than CPUs: they share, one CPU each
        return [(order[i % len(order)],) for i in range(n)]
    k = len(order) // n
    return [tuple(sorted(order[i * k:(i + 1) * k])) for i in range(n)]


class ReplicaBase:
    """One engine replica: pins itself, loads the model, builds the app (Ray calls
    __serve_build_asgi_app__ after __init__)."""

    def __init__(self, model_path: str, n_sets: int, model_name: str, limits, engine_kwargs: dict,
                 max_context=None):
        from ray import serve

        from mixqrt.pipeline import Pipeline
        if os.environ.get(_RAY_LOCAL_ENV) == "0":
            _replica_grpc_on_loopback()
        ctx = serve.get_replica_context()
        rank = getattr(getattr(ctx, "rank", None), "local_rank", None)
        if rank is None:                                    # older Ray: no ranks
            rank = abs(hash(str(getattr(ctx, "replica_tag", os.getpid()))))
        self.cpus = core_sets(n_sets)[rank % n_sets]
        os.sched_setaffinity(0, self.cpus)                  # the process: kernel threads inherit it
        kw = dict(engine_kwargs)
        threads = kw.get("threads") or len(self.cpus)
        kw["threads"] = threads
        self.replica = f"{socket.gethostname()}-{rank}"
        self.pipe = Pipeline(model_path, threads=threads, progress=False, offline=True, max_context=max_context,
                             weights_in_memory=True)       # as `mixqrt serve`: the file may change under it
        self.model_name, self.limits, self.engine_kwargs = model_name, limits, kw

    def __serve_build_asgi_app__(self):
        from mixqrt.serving.server.app import create_app
        app = create_app(self.pipe, model=self.model_name, limits=self.limits, replica=self.replica,
                         engine_kwargs=self.engine_kwargs)
        app.state.server.extra_health = {"replica": self.replica, "cpus": format_cpulist(self.cpus),
                                         "pid": os.getpid()}
        return app


def build(model_path, *, model_name: str, limits, engine_kwargs: dict, replicas: int | None = None,
          min_replicas: int | None = None, max_replicas: int | None = None, max_context=None,
          cpus_per_replica: float | None = None):
    """The bound Ray Serve application (pass to serve.run)."""
    from ray import serve

    if min_replicas is not None or max_replicas is not None:
        lo = min_replicas or 1
        hi = max(max_replicas or lo, lo)
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                          "target_ongoing_requests": engine_kwargs.get("max_slots", 8)}}
        n_sets = hi
    else:
        n_sets = replicas or 1
        scaling = {"num_replicas": n_sets}
    if cpus_per_replica is None:
        cpus_per_replica = max(1, usable_cpus() // n_sets)   # the one CPU-count policy
    slots = engine_kwargs.get("max_slots", 8) + engine_kwargs.get("max_queue", 64)
    cls = serve.ingress()(type("MixqrtReplica", (ReplicaBase,), {}))
    dep = serve.deployment(cls, name="mixqrt", ray_actor_options={"num_cpus": cpus_per_replica},
                           max_ongoing_requests=slots, **scaling)
    return dep.bind(str(model_path), n_sets, model_name, limits, engine_kwargs, max_context)


LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Ray reads this once, at import: "0" makes a Linux node use the loopback address as its node IP
# (as Ray does by default on macOS/Windows), and every Ray server then listens on 127.0.0.1 only
_RAY_LOCAL_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_local(host: str, address) -> bool:
    """For a local Ray started here (no `address`) behind a loopback `host`: make Ray's own servers
    (GCS, raylet, object manager, workers, agents) listen on loopback only, not on every interface.
    Call before `import ray` (a Ray already imported is patched too, best effort). True if applied."""
    if address is not None or host not in LOOPBACK:
        return False
    os.environ[_RAY_LOCAL_ENV] = "0"                    # Ray's child processes read it at import
    import sys
    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None:
        consts.ENABLE_RAY_CLUSTER = False
    return True


def _replica_grpc_on_loopback() -> None:
    """Ray Serve (2.60) starts each replica's inter-deployment gRPC server on "[::]:0", every
    interface, whatever the node's address. In keep_ray_local's mode this replica's process binds
    it to 127.0.0.1 instead (the proxy reaches it by the node address, which is loopback there).
    Patches a private Ray function, so it is checked by tests/test_serve_ray.py, which lists the
    sockets the server's processes listen on."""
    try:
        from ray.serve._private import replica as ray_replica
    except ImportError:
        return
    real = getattr(ray_replica, "add_port_to_grpc_server", None)
    if real is None or getattr(real, "mixqrt_loopback", False):
        return

    def on_loopback(server, address: str):
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = f"127.0.0.1:{port}"
        return real(server, address)
    on_loopback.mixqrt_loopback = True
    ray_replica.add_port_to_grpc_server = on_loopback


def serve_ray(model_path, *, host: str, port: int, address=None, **build_kw) -> None:
    """Start (or join, with `address`) Ray, deploy build(model_path, **build_kw) on host:port, run
    until Ctrl-C or SIGTERM, then shut Serve and Ray down (a local Ray's processes with it).
    `mixqrt serve MODEL --ray ...` calls this after quantizing MODEL once."""
    import signal
    import threading
    import time

    keep_ray_local(host, address)
    import ray
    from ray import serve

    from mixqrt.io.atomic import Terminated
    ray.init(address=address, include_dashboard=False, logging_level="WARNING")
    main = threading.current_thread() is threading.main_thread()
    if main:
        def _terminated(signum, frame):              # ray.init's own handler exits without shutting down
            raise Terminated(f"signal {signum}")
        signal.signal(signal.SIGTERM, _terminated)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(model_path, **build_kw), name="mixqrt", route_prefix="/")
        print(f"mixqrt serve: Ray Serve at http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except Terminated:
        raise
    except KeyboardInterrupt:
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # no second interruption of the shutdown
        try:
            serve.shutdown()
        finally:
            ray.shutdown()                          # a local Ray: its processes (agents included) go too
