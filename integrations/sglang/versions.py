"""The SGLang releases this plugin is written against, checked when SGLang loads it.

The plugin replaces functions by their dotted names and calls them with their signatures, so it
is bound to the releases whose fused path it was read from: 0.5.11 to 0.5.17 (the releases built
for torch 2.11). Outside them it refuses to load with one line that says what it found.
"""
from __future__ import annotations

import re
from importlib import metadata
from typing import Optional

MIN_VERSION = (0, 5, 11)  # first release checked, inclusive
MAX_VERSION = (0, 5, 17)  # last release checked, inclusive (its .postN builds too)


class SGLangVersionError(RuntimeError):
    """The installed SGLang is outside the releases the plugin supports (or not installed)."""


def _release(version: str) -> Optional[tuple[int, int, int]]:
    """``(major, minor, patch)`` of a PEP 440 version such as ``0.5.13.post1`` or ``0.5.15rc0``;
    None when it does not start with three numbers."""
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def supported_range() -> str:
    return f"{'.'.join(map(str, MIN_VERSION))} to {'.'.join(map(str, MAX_VERSION))}"


def check_sglang_version(version: Optional[str] = None) -> str:
    """The installed (or given) SGLang version when it lies in the supported range; else
    `SGLangVersionError` with a one-line message."""
    if version is None:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            raise SGLangVersionError("arfusion's SGLang plugin: sglang is not installed") from None
    release = _release(version)
    if release is None or not MIN_VERSION <= release <= MAX_VERSION:
        raise SGLangVersionError(f"arfusion's SGLang plugin supports sglang {supported_range()}, found {version}: "
                                 "install one of those, or unset ARFUSION_SGLANG")
    return version
