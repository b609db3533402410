"""`ruff check` passes on the whole repository at the settings of pyproject.toml's ``[tool.ruff]``
(ruff comes with the test extra), and those settings report an unused import."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def ruff_check(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=100)


def test_ruff_finds_nothing_in_the_repository():
    result = ruff_check(".", cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_settings_report_an_unused_import(tmp_path: Path):
    (tmp_path / "module.py").write_text("import os\n")
    result = ruff_check("--config", str(ROOT / "pyproject.toml"), "module.py", cwd=tmp_path)
    assert result.returncode == 1 and "F401" in result.stdout, result.stdout + result.stderr
