"""``python -m benchmarks.gsm8k``: see `benchmarks.gsm8k.bench`."""
import sys

from benchmarks.gsm8k.bench import main

sys.exit(main())
