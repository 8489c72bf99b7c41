"""The supported and tested transformers / accelerate / torch versions, and the check run on import.

What differs between the versions in that range is decided in `layerwise_hf.platform.compat`, which re-exports these.
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# package -> (oldest supported, newest tested) as major.minor; any patch release of either counts as tested.
# Kept equal to pyproject.toml's lower bounds by tests/test_compat.py; ci/oldest.txt and ci/newest.txt pin the two
# ends that CI runs.
SUPPORTED_VERSIONS = {
    "transformers": ("4.55", "5.24"),
    "accelerate": ("1.10", "1.15"),
    "torch": ("2.6", "2.14"),
}

_WARNED: set[str] = set()


class UnsupportedVersionError(RuntimeError):
    """An installed transformers / accelerate / torch is older than the supported range, or a Trainer method the
    plugin relies on is missing or has other parameters than in the tested versions."""


class UntestedVersionWarning(UserWarning):
    """An installed transformers / accelerate / torch is newer than the newest version tested with this plugin."""


def installed_version(package: str) -> str | None:
    """The installed distribution's version string, `None` when it is not installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def tested_range() -> str:
    """
    The supported and tested versions in words, for messages.

    Example:

    ```python
    >>> from layerwise_hf.platform.versions import tested_range
    >>> tested_range()
    'transformers 4.55 to 5.24, accelerate 1.10 to 1.15, torch 2.6 to 2.14'
    ```
    """
    return ", ".join(f"{package} {low} to {high}" for package, (low, high) in SUPPORTED_VERSIONS.items())


def check_versions() -> None:
    """
    Refuse transformers / accelerate / torch older than the supported range with `UnsupportedVersionError` (naming
    each, its installed version, and the pip command that fixes it); warn once per package, with
    `UntestedVersionWarning`, for one newer than the newest tested (it still runs).

    Example:

    ```python
    >>> from layerwise_hf.platform.versions import check_versions
    >>> check_versions()  # silent within the tested range
    ```
    """
    too_old, too_new = [], []
    for package, (low, high) in SUPPORTED_VERSIONS.items():
        installed = installed_version(package)
        if installed is None:
            continue  # an import error names it, where it is used
        release = Version(installed).release
        if release < Version(low).release:
            too_old.append((package, installed, low))
        elif release[:2] > Version(high).release[:2] and package not in _WARNED:
            too_new.append((package, installed))
    if too_old:
        found = ", ".join(f"{package} {installed} (needs >= {low})" for package, installed, low in too_old)
        fix = " ".join(f"'{package}>={low}'" for package, _, low in too_old)
        raise UnsupportedVersionError(
            f"layerwise_hf does not support {found}. Supported and tested: {tested_range()}. "
            f"Upgrade with: pip install {fix}"
        )
    for package, installed in too_new:
        _WARNED.add(package)
        warnings.warn(
            f"layerwise_hf is tested with {tested_range()}; {package} {installed} is newer and was not tested. It "
            "runs; if training fails or differs from the standard optimizer, please report it with the versions.",
            UntestedVersionWarning,
            stacklevel=2,
        )
