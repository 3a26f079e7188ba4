"""python -m mixqrt.testing [KEY ...]: fetch and verify the real test models (all by default) and print
their paths. The test suite does the same on first use; this only does it up front."""
import argparse
import sys

from mixqrt.errors import ModelError
from mixqrt.testing.models import MODELS, model_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mixqrt.testing", description=__doc__.splitlines()[0])
    ap.add_argument("keys", nargs="*", metavar="KEY",
                    help=f"which models ({', '.join(MODELS)}); default all")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    for key in a.keys:
        if key not in MODELS:
            ap.error(f"unknown model {key!r}; choose from {', '.join(MODELS)}")
    try:
        for key in a.keys or MODELS:
            print(f"{key}: {model_path(key, progress=not a.quiet)}", flush=True)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
