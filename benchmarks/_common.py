"""Helpers shared by the benchmark scripts: the machine, the code version, resource usage."""
from __future__ import annotations

import hashlib
import os
import re
import resource
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    """'abc1234' or 'abc1234+dirty' (uncommitted changes under mixqrt/ or benchmarks/); outside a git
    checkout (a copied tree) $MIXQRT_GIT_COMMIT names it."""
    head = git("rev-parse", "--short=12", "HEAD") or os.environ.get("MIXQRT_GIT_COMMIT") or "unknown"
    dirty = git("status", "--porcelain", "--", "mixqrt", "benchmarks", "setup.py")
    return head + ("+dirty" if dirty else "")


def tree_hash(*rel_dirs: str, suffixes=(".py", ".pyx", ".pxd", ".c", ".h", ".so")) -> str:
    """Content hash of the source (and built extension) files under the given folders: a change
    anywhere in them changes the hash, committed or not."""
    h = hashlib.sha256()
    for rel in rel_dirs:
        base = ROOT / rel
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in suffixes)
        for p in files:
            if "__pycache__" in p.parts:
                continue
            h.update(str(p.relative_to(ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def file_id(path) -> str:
    """Cheap identity of a large file: name, size and mtime (hashing GBs each run is not cheap)."""
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{int(st.st_mtime)}"


def ram_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def best_time(fn, reps: int, tries: int = 5, clock=time.perf_counter) -> float:
    """Seconds per call of fn: the best of `tries` batches of `reps` calls (after one warm-up call),
    which other work on a shared machine disturbs less than a mean or a median."""
    fn()
    best = float("inf")
    for _ in range(tries):
        t = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - t) / reps)
    return best


def machine_info() -> dict:
    """CPU model, cores, RAM, ISA tier (mixqrt.commands.doctor.report()), load average, date, commit."""
    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "git_commit": git_commit(),
            "ram_bytes": ram_bytes(), "loadavg": os.getloadavg()}
    try:
        from mixqrt.commands.doctor import report
        rep = report()
        info.update(cpu_model=rep.get("cpu_model"), cpu_vendor=rep.get("cpu_vendor"), isa=rep.get("isa"),
                    usable_cpus=rep.get("usable_cpus"), logical_cpus=rep.get("logical_cpus"))
    except Exception as e:  # informative only
        info.update(cpu_model=f"unknown ({e})", usable_cpus=len(os.sched_getaffinity(0)), logical_cpus=os.cpu_count())
    try:
        import llama_cpp
        info["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        info["llama_cpp_python"] = None
    info["llama_cpp_bin"] = os.environ.get(LLAMA_CPP_BIN_ENV)
    return info


LLAMA_CPP_BIN_ENV = "MIXQRT_LLAMA_CPP_BIN"


def llama_cpp_bin(tool: str) -> Path:
    """Path of a llama.cpp command-line tool (llama-server, llama-quantize, llama-perplexity): the
    folder $MIXQRT_LLAMA_CPP_BIN first (benchmarks/llamacpp_build.sh prints it), then $PATH.
    FileNotFoundError saying how to build it otherwise. The Python bindings need no variable:
    `import llama_cpp` finds the package the same script installs."""
    import shutil

    folder = os.environ.get(LLAMA_CPP_BIN_ENV)
    if folder:
        p = Path(folder).expanduser() / tool
        if p.is_file() and os.access(p, os.X_OK):
            return p
    found = shutil.which(tool)
    if found:
        return Path(found)
    raise FileNotFoundError(f"{tool} not found in ${LLAMA_CPP_BIN_ENV} ({folder or 'unset'}) or on PATH: "
                            f"build it with benchmarks/llamacpp_build.sh and export {LLAMA_CPP_BIN_ENV}")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CpuMeter:
    """Process CPU time / wall time / threads over a with-block (1.0 = every thread busy throughout)."""

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self.utilisation = self.wall = self.cpu = None

    def __enter__(self):
        self._t = time.perf_counter()
        self._c = self._cpu()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self._t
        self.cpu = self._cpu() - self._c
        self.utilisation = self.cpu / self.wall / self.threads if self.wall > 0 else None
        return False

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime


# an absolute path (or ../shared/...) outside the repository, up to its last component
_OUTSIDE = re.compile(r"(?<![\w.~-])(?:/(?:tmp|work|root|home|mnt|media|srv|scratch|data|var|opt|dev/shm)|\.\./shared)"
                      r"(?:/[\w.+-]+)*/([\w.+-]+)")


def shown(text: str) -> str:
    """Text for a docs/ page: paths inside the repository relative to its root, paths outside it (a
    scratch folder, a model cache, ../shared) as their last component, since a reader cannot follow
    them. tests/test_docs.py checks that no page names one."""
    return _OUTSIDE.sub(r"\1", text.replace(str(ROOT) + os.sep, ""))


def provenance(command: str) -> str:
    """Markdown lines: the command, the machine, the date and commit (for the docs/ tables)."""
    command = shown(command)
    m = machine_info()
    ram = f"{m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
    return (f"- command: `{command}`\n"
            f"- machine: {m.get('cpu_vendor', '')} {m['cpu_model']}, {m['usable_cpus']} usable cores, {ram}, "
            f"ISA tier {m.get('isa')}\n"
            f"- date: {m['date_utc']}, commit {m['git_commit']}\n")


def gguf_decode_bytes(path) -> int | None:
    """Bytes of every tensor of a GGUF except token_embd (what one decode step reads: one embedding
    row is gathered), or None when the file is missing."""
    if not Path(path).exists():
        return None
    import gguf
    r = gguf.GGUFReader(str(path))
    return int(sum(int(t.n_bytes) for t in r.tensors if t.name != "token_embd.weight"))


# ----------------------------------------------------------------------------------- concurrent requests
def read_concurrently(reqs) -> list[list[float]]:
    """Drain engine requests, one reader thread each -> the arrival time of each piece, per request."""
    import threading
    times: list[list[float]] = [[] for _ in reqs]

    def read(i):
        for _ in reqs[i]:
            times[i].append(time.perf_counter())
    ts = [threading.Thread(target=read, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return times


def window_rates(times: list[list[float]], t0: float) -> dict:
    """Aggregate rates of concurrent requests: decode_tps over the window where every request
    decodes (after the last first token, until the first one is done), e2e_tps from t0 to the last
    token, and the slowest first token."""
    start = max(t[0] for t in times)               # every request has its first token
    end = min(t[-1] for t in times)                # the first one is done
    n = sum(sum(1 for x in t if start < x <= end) for t in times)
    return {"decode_tps": n / (end - start) if end > start else 0.0,
            "e2e_tps": sum(len(t) for t in times) / (max(t[-1] for t in times) - t0),
            "ttft_max_s": start - t0, "tokens": sum(len(t) for t in times)}


# ----------------------------------------------------------------------------------- docs/ output
# Benchmarks own only the tables of a docs/ page: each sits between a pair of markers, and the prose
# around them is written by hand. Raw results go to docs/data/NAME.json next to the page.
BEGIN, END = "<!-- BEGIN mixqrt:{} -->", "<!-- END mixqrt:{} -->"


def _write_atomic(path: Path, text: str) -> None:
    """Write via mixqrt's one atomic writer (a unique temp in the same folder + fsync + rename):
    a reader (or a crash) never sees a half-written page, and two writers never share a temp."""
    from mixqrt.io.atomic import atomic_write
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path, obj) -> None:
    """Atomically write obj as indented JSON (non-JSON values such as dataclasses become strings)."""
    import json
    _write_atomic(Path(path), json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def replace_blocks(text: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """Put each blocks[name] between its BEGIN/END markers in text. Returns (new text, names whose
    markers were missing: those blocks are appended at the end, so a long run's tables are never lost).
    Raises ValueError on a BEGIN without its END, or markers out of order."""
    missing = []
    for name, body in blocks.items():
        b, e = BEGIN.format(name), END.format(name)
        i, j = text.find(b), text.find(e)
        if i < 0 and j < 0:
            missing.append(name)
            text = text.rstrip("\n") + f"\n\n{b}\n{body.strip(chr(10))}\n{e}\n"
            continue
        if i < 0 or j < i or text.count(b) != 1 or text.count(e) != 1:
            raise ValueError(f"block '{name}': expected one '{b}' followed by one '{e}'")
        text = text[:i + len(b)] + "\n" + body.strip("\n") + "\n" + text[j:]
    return text, missing


def update_doc(path, blocks: dict[str, str], title: str = "") -> None:
    """Replace the generated blocks of a docs/ page in place, atomically, keeping its hand-written
    prose. A page that does not exist yet gets a skeleton (the title and every block, in order)."""
    path = Path(path)
    text = path.read_text() if path.exists() else f"# {title or path.stem}\n"
    new, missing = replace_blocks(text, {name: shown(body) for name, body in blocks.items()})
    if missing and path.exists():
        import sys
        print(f"{path}: no markers for {', '.join(missing)}; appended at the end (move them where they belong)",
              file=sys.stderr)
    _write_atomic(path, new)


def last_json(text: str):
    """The last line of a child's output that parses as JSON (a report printed after its logs), else
    the whole text as JSON, else None."""
    import json
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
