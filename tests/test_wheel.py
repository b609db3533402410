"""What `pip install arfusion` puts into a user's environment: one top-level package, `arfusion`
(`arfusion.fusion`, `arfusion.engine`, ...), never the generic names of the repository's folders
(`fusion`, `engine`, `layers`, ...) that another distribution may also install.

The wheel is built from a copy of this checkout (pyproject.toml, README.md, the package folders),
offline (``--no-build-isolation``: setuptools comes from the test extra), and installed with
``--no-deps`` into a fresh virtual environment that sees this environment's site-packages (torch,
the other dependencies, pip) through a .pth file: like ``--system-site-packages``, but also from
inside a virtual environment, and without running this environment's .pth files (its own
editable arfusion, if any, stays out). The editable install (`pip install -e .`) is checked the
same way: the checkout is importable as `arfusion`."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fusion", "layers", "server_args", "engine", "benchmarks", "integrations")
# modules a user or an engine imports by name: the server, the op, the plugins' entry modules
IMPORTS = ("arfusion.fusion", "arfusion.layers.communicator", "arfusion.server_args", "arfusion.engine.launch_server",
           "arfusion.benchmarks.bench_serving", "arfusion.integrations.vllm", "arfusion.integrations.sglang.plugin")
CHECK = """
import importlib, importlib.metadata, json, sys
files = {name: importlib.import_module(name).__file__ for name in sys.argv[1:]}
dist = importlib.metadata.distribution("arfusion")
entry_points = {ep.group + ":" + ep.name: ep.value for ep in dist.entry_points}
loaded = {ep.group + ":" + ep.name: callable(ep.load()) for ep in dist.entry_points}
print(json.dumps({"files": files, "entry_points": entry_points, "loaded": loaded}))
"""


def source_copy(dest: Path) -> Path:
    """What the build reads from this checkout, copied to ``dest`` (the build writes build/ and
    *.egg-info/ beside its input)."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    return dest


def run(cmd: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` without this process's PYTHONPATH (which may map the checkout), from ``cwd``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def fresh_venv(path: Path) -> Path:
    """An empty virtual environment that also sees this environment's site-packages; its python."""
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent, timeout=120)
    python = path / "bin" / "python"
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]  # not PYTHONPATH's
    (site_packages(python) / "zz_outer_environment.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def site_packages(python: Path) -> Path:
    proc = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=python.parent, timeout=60)
    return Path(proc.stdout.strip())


def installed_imports(python: Path, cwd: Path) -> dict:
    """`CHECK` in the venv: each of IMPORTS's files and the distribution's entry points, loaded."""
    proc = run([python, "-c", CHECK, *IMPORTS], cwd=cwd, timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = source_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out, src],
        cwd=src, timeout=300)
    (found,) = out.glob("arfusion-*.whl")
    return found


def test_the_wheel_holds_one_top_level_package_with_every_module(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"arfusion"}, sorted(top)
    expected = {f"arfusion/{p.relative_to(ROOT).as_posix()}" for name in PACKAGES for p in (ROOT / name).rglob("*.py")
                if "__pycache__" not in p.parts}
    assert not expected - set(names), f"missing from the wheel (list the package in pyproject.toml): {sorted(expected - set(names))}"
    assert "arfusion/fusion/dispatch/tables/strategy_table.json" in names


def test_the_installed_wheel_imports_as_arfusion_and_adds_no_other_top_level_name(wheel: Path, tmp_path: Path):
    python = fresh_venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp_path, timeout=300)
    site = site_packages(python)
    added = {p.name for p in site.iterdir() if p.name not in ("__pycache__", "zz_outer_environment.pth")}
    assert {n for n in added if not n.startswith("arfusion")} == set(), sorted(added)
    assert not {n for n in PACKAGES if (site / n).exists()}
    found = installed_imports(python, tmp_path)
    assert all(Path(f).resolve().is_relative_to(site.resolve()) for f in found["files"].values()), found["files"]
    assert found["entry_points"] == {"vllm.general_plugins:arfusion": "arfusion.integrations.vllm:register",
                                     "sglang.srt.plugins:arfusion": "arfusion.integrations.sglang.plugin:register"}
    assert all(found["loaded"].values()), found["loaded"]
    # the server's entry module runs by its new name from anywhere
    proc = run([python, "-m", "arfusion.engine.launch_server", "--help"], cwd=tmp_path, timeout=300)
    assert "usage: python -m arfusion.engine.launch_server" in proc.stdout


def test_the_editable_install_maps_the_checkout_to_arfusion(tmp_path: Path):
    src = source_copy(tmp_path / "src")
    python = fresh_venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", src],
        cwd=tmp_path, timeout=300)
    found = installed_imports(python, tmp_path)
    assert all(Path(f).resolve().is_relative_to(src.resolve()) for f in found["files"].values()), found["files"]
    assert all(found["loaded"].values()), found["loaded"]
