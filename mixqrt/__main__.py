import sys
from mixqrt.cli import main
sys.exit(main())
