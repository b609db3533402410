"""``python -m benchmarks.mmlu``: see `benchmarks.mmlu.bench`."""
import sys

from benchmarks.mmlu.bench import main

sys.exit(main())
