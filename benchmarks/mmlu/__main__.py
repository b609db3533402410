"""``python -m arfusion.benchmarks.mmlu``: see `benchmarks.mmlu.bench`."""
import sys

from arfusion.benchmarks.mmlu.bench import main

sys.exit(main())
