"""The tiny test model lives in mixqrt.testing.tiny (shipped with the package, so the wheel smoke test
and the benchmarks build it too). `import tinymodel` in a test is that very module (one module
object, so monkeypatching its constants reaches its functions)."""
import sys

import mixqrt.testing.tiny as _tiny

sys.modules[__name__] = _tiny
