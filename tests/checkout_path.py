"""A folder in which `arfusion` is a given checkout. The repository root is the package `arfusion`
(pyproject.toml: ``package-dir``), so the root itself on PYTHONPATH makes nothing importable as
`arfusion`; a link named ``arfusion`` to it does. A child process started with that folder first on
its PYTHONPATH runs that checkout's code, whatever arfusion is installed."""
from pathlib import Path


def checkout_on_path(root: Path, folder: Path) -> str:
    """Link ``folder/arfusion`` -> ``root`` (``folder`` is created if missing); the PYTHONPATH
    entry to use: ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "arfusion").symlink_to(root.resolve(), target_is_directory=True)
    return str(folder)
