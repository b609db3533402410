"""The import layering stated as import-linter contracts in pyproject.toml (``[tool.importlinter]``:
fusion <- layers <- engine <- benchmarks, server_args read by the engine only, the engine plugins
in integrations/ on fusion alone, the engine's
sub-packages in one order (supervision beside scheduling, above runtime), the server's parts in
one order (rank 0's root > the engine > api > http), supervision's modules in one order
(supervisor > workers > tp_worker | watchdog > heartbeat), no cycle between the modules of one
package) holds on this checkout,
and an import against it breaks the contract it crosses (on a copy of the packages with that
one import added)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkout_path import checkout_on_path

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fusion", "layers", "server_args", "engine", "benchmarks", "integrations")
# An editable install (setuptools' ``__editable__`` finder and its sys.path entry) would add the
# installed checkout to `arfusion`'s namespace path: the lint drops both, so it reads only the
# checkout on PYTHONPATH.
LINT = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]; "
        "sys.path[:] = [p for p in sys.path if '__editable__' not in p]; "
        "from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))")
TOP = "fusion <- layers <- engine <- benchmarks"
ENGINE = "engine: entry points > server"
SERVER = "engine.server: rank 0's root > the engine > api"
SUPERVISION = "engine.supervision: supervisor > workers"
ACYCLIC = "no import cycles between the modules of one package"


def lint(root: Path, path: str) -> subprocess.CompletedProcess:
    """`lint-imports` with ``root``'s pyproject.toml's contracts on the package `arfusion` found
    on ``path`` (the PYTHONPATH)."""
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)


def test_the_import_contracts_are_kept(tmp_path: Path):
    result = lint(ROOT, checkout_on_path(ROOT, tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("module", "statement", "contract"), [
    ("fusion/__init__.py", "import arfusion.layers.linear", TOP),
    ("layers/linear.py", "import arfusion.engine.models.config", TOP),
    ("layers/linear.py", "import arfusion.server_args", TOP),
    ("engine/bench_one_batch.py", "import arfusion.benchmarks.client", TOP),
    ("integrations/sglang/hooks.py", "import arfusion.layers.linear", TOP),
    ("fusion/__init__.py", "import arfusion.integrations.sglang.plugin", TOP),
    ("server_args/server_args.py", "import arfusion.engine.launch_config", TOP),
    ("engine/runtime/sampler.py", "import arfusion.engine.scheduling.request", ENGINE),
    ("engine/scheduling/request.py", "import arfusion.engine.server.api.engine_client", ENGINE),
    ("engine/supervision/supervisor.py", "import arfusion.engine.server.engine", ENGINE),
    ("engine/runtime/rank_stack.py", "import arfusion.engine.scheduling.scheduler", ENGINE),
    ("engine/server/http/limits.py", "import arfusion.engine.server.api.protocol", SERVER),
    ("engine/server/api/app.py", "import arfusion.engine.server.engine", SERVER),
    ("engine/server/engine.py", "import arfusion.engine.server.rank0", SERVER),
    ("engine/models/builtin.py", "import arfusion.engine.tokenizers.tokenizer", ENGINE),
    ("engine/supervision/tp_worker.py", "import arfusion.engine.launch_config", ENGINE),
    ("engine/runtime/rank_stack.py", "import arfusion.engine.supervision.heartbeat", ENGINE),
    ("engine/scheduling/scheduler.py", "import arfusion.engine.supervision.supervisor", ENGINE),
    ("engine/supervision/watchdog.py", "import arfusion.engine.scheduling.scheduler", ENGINE),
    ("engine/supervision/heartbeat.py", "import arfusion.engine.supervision.watchdog", SUPERVISION),
    ("engine/supervision/tp_worker.py", "import arfusion.engine.supervision.workers", SUPERVISION),
    ("engine/runtime/model_runner.py", "import arfusion.engine.runtime.warm_up", ACYCLIC),
    ("layers/parallel_state.py", "import arfusion.layers.linear", ACYCLIC),
])
def test_an_import_against_the_layering_breaks_its_contract(tmp_path: Path, module: str, statement: str,
                                                             contract: str):
    copy = tmp_path / "arfusion"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    with open(copy / module, "a") as f:
        f.write(f"\n{statement}  # against the layering\n")
    result = lint(copy, str(tmp_path))
    assert result.returncode != 0, result.stdout + result.stderr
    verdicts = re.findall(rf"^{re.escape(contract)}.* (KEPT|BROKEN)\b", result.stdout, flags=re.M)
    assert verdicts == ["BROKEN"], result.stdout
