"""The server commands the README's "Use it" section gives parse as `ServerArgs`, and one of
them is the CPU form of the fused example (the torch backend: on a CPU the flashinfer backend
is refused, and without flashinfer it runs unfused)."""
import fnmatch
import re
import shlex
from pathlib import Path

from arfusion.server_args import ServerArgs

README = Path(__file__).resolve().parent.parent / "README.md"
LAUNCH = "python -m arfusion.engine.launch_server"


def use_it_commands() -> list[list[str]]:
    """The arguments of each launch_server command in the "Use it" section."""
    section = re.search(r"^## Use it$(.*?)^## ", README.read_text(), re.S | re.M)
    assert section, "README has a 'Use it' section"
    return [shlex.split(line.strip()[len(LAUNCH):]) for line in section.group(1).splitlines()
            if line.strip().startswith(LAUNCH)]


def test_use_it_shows_the_gpu_and_the_cpu_form_of_the_fused_server():
    parsed = [ServerArgs.from_cli(argv) for argv in use_it_commands()]
    fused = [a for a in parsed if a.enable_flashinfer_allreduce_fusion and a.tp_size > 1]
    assert {a.allreduce_fusion_backend for a in fused} == {"flashinfer", "torch"}
    cpu = next(a for a in fused if a.allreduce_fusion_backend == "torch")
    ServerArgs.validated(**{**cpu.model_dump(), "device": "cpu"})  # valid on a CPU as given


def test_the_virtual_environments_the_readme_suggests_are_ignored_by_git():
    """``python -m venv .venv`` (the README) and the integrations' ``.venv-*`` stay out of git."""
    assert "python -m venv .venv" in README.read_text()
    patterns = [line.strip() for line in (README.parent / ".gitignore").read_text().splitlines()]
    for directory in (".venv", ".venv-vllm", ".venv-sglang", ".venv-py312"):
        assert any(fnmatch.fnmatch(f"/{directory}/", p) for p in patterns), directory
