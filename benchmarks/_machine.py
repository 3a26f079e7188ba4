"""Machine and provenance lines shared by the benchmark reports."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys


def machine_line() -> str:
    from mixqrt.doctor import report
    info = report()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{info['cpu_vendor']} {info['cpu_model']}, {info['usable_cpus']} usable cores, {mem:.0f} GiB RAM, "
            f"ISA tier {info['isa']}, Python {platform.python_version()}, {platform.system()} {platform.release()}")


def provenance(command: str | None = None) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    cmd = command or "python " + " ".join(sys.argv)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"- command: `{cmd}`\n- machine: {machine_line()}\n- date: {now}, commit {commit}\n"
