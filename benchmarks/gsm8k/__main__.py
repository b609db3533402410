"""``python -m arfusion.benchmarks.gsm8k``: see `benchmarks.gsm8k.bench`."""
import sys

from arfusion.benchmarks.gsm8k.bench import main

sys.exit(main())
