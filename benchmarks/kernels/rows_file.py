"""The kernel benchmarks' rows written as the JSON file their ``--out`` / ``--json-file`` names."""
from __future__ import annotations

import json
from typing import Any, Optional


def write_rows(path: Optional[str], rows: Any) -> None:
    """``rows`` as indented JSON into ``path`` (replaced); nothing when ``path`` is None or empty."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
