"""Build: one Cython extension per ``mixqrt/_kernels/_NAME.pyx``.

Each extension compiles ``_NAME.pyx`` with every C file in ``src/NAME/`` and ``src/common/``.
ISA-specific C files carry their tier in the file name (``*_avx2.c``, ``*_avx512.c``) and get
their -m flags per file here; nothing is built with -march=native, so one wheel runs on any
x86-64 and the tier is chosen at import from cpuid + xgetbv (see src/common/cpu.c).
"""
import glob
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
KDIR = os.path.join("mixqrt", "_kernels")
IS_X86 = any(a in (os.uname().machine if hasattr(os, "uname") else "x86_64") for a in ("x86_64", "AMD64", "i686"))

ISA_FLAGS = {
    "_avx2.c": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "_avx512.c": ["-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl",
                  "-mavx512dq", "-mavx512vnni", "-mavx512vbmi"],
}
BASE_FLAGS = ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wno-unused-function",
              "-Wno-unknown-pragmas", "-fvisibility=hidden"]


class IsaBuildExt(build_ext):
    """Adds per-file -m flags to ISA-tier sources; other files get only the portable base flags."""

    def build_extensions(self):
        compiler = self.compiler
        orig = compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs)
            for suffix, flags in ISA_FLAGS.items():
                if src.endswith(suffix):
                    if not IS_X86:
                        return  # non-x86: tier files compile to nothing; dispatch never selects them
                    extra += flags
            return orig(obj, src, ext, cc_args, extra, pp_opts)

        compiler._compile = _compile
        super().build_extensions()


def extensions():
    exts = []
    only = [n for n in os.environ.get("MIXQRT_BUILD_ONLY", "").split(",") if n]  # dev: rebuild a subset
    for pyx in sorted(glob.glob(os.path.join(KDIR, "_*.pyx"))):
        name = os.path.splitext(os.path.basename(pyx))[0]
        if only and name not in only:
            continue
        sub = name.lstrip("_")
        csrc = sorted(glob.glob(os.path.join(KDIR, "src", sub, "*.c")))
        csrc += sorted(glob.glob(os.path.join(KDIR, "src", "common", "*.c")))
        if not IS_X86:
            csrc = [c for c in csrc if not any(c.endswith(s) for s in ISA_FLAGS)]
        exts.append(Extension(
            f"mixqrt._kernels.{name}",
            sources=[pyx] + csrc,
            # headers and included .pxi too: an edit to one alone (misc_impl.h, mq_format.h,
            # _ops_matmul.pxi) rebuilds the extension
            depends=sorted(glob.glob(os.path.join(KDIR, "src", sub, "*.h"))
                           + glob.glob(os.path.join(KDIR, "src", "common", "*.h"))
                           + glob.glob(os.path.join(KDIR, f"{name}_*.pxi"))),
            include_dirs=[np.get_include(), os.path.join(KDIR, "src", "common"), os.path.join(KDIR, "src", sub)],
            extra_compile_args=BASE_FLAGS,
            extra_link_args=["-pthread"],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        ))
    return cythonize(exts, language_level=3, compiler_directives={
        "boundscheck": False, "wraparound": False, "cdivision": True, "initializedcheck": False,
        "embedsignature": True,
    })


setup(ext_modules=extensions(), cmdclass={"build_ext": IsaBuildExt})
