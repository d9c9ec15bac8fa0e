"""The trainer releases each adapter supports, stated once, and the check every adapter runs when it
is imported.

A range holds only releases the test suite runs the adapter against (``scripts/setup_sglang_env.sh``
installs them; docs/trainers.md and the ``pyproject.toml`` extras quote this table):

- verl 0.9.0 lacks ``verl.workers.rollout.router`` (the SPEC-RL agent loop and the prompt-affinity
  router import it) and the ``router_config_path`` key; 0.9.1 is the only release from there on.
- OpenRLHF 0.11.0 names its flag ``--algo.advantage.is_correction_enable``, not the
  ``--algo.advantage.is_correction_level`` the example passes; 0.11.1 is not tested.
- slime is installed from source (``pip install -e``), whose version is read from its metadata; a
  checkout that is only on ``sys.path`` has none and is not checked.
"""

from __future__ import annotations

import importlib.metadata
import logging

logger = logging.getLogger("histospec_sgl.integrations")

#: distribution name -> the supported releases (a PEP 440 specifier).
SUPPORTED: dict[str, str] = {
    "verl": ">=0.9.1,<0.10",
    "openrlhf": ">=0.11.2,<0.12",
    "slime": ">=0.3.1,<0.4",
}


class UnsupportedTrainerVersion(ImportError):
    """The installed trainer is outside the adapter's supported range."""


def installed(dist: str) -> str | None:
    """The installed version of ``dist``, or None when it has no metadata."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def problem(dist: str, version: str | None = None) -> str | None:
    """One line saying why the installed (or the given) version of ``dist`` is unsupported, or None
    when it is supported (or not installed as a distribution)."""
    spec = SUPPORTED[dist]
    version = installed(dist) if version is None else version
    if version is None:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(version) in SpecifierSet(spec)
    except InvalidVersion:
        ok = False
    if ok:
        return None
    if dist == "slime":  # not on PyPI: installed from its source
        how = "install a supported slime from its source (pip install -e <slime checkout>)"
    else:
        from histospec_sgl.install import pip_line

        how = f"{pip_line(dist)} installs a supported release"
    return f"histospec-sgl supports {dist}{spec}, and {dist} {version} is installed: {how}"


def require(dist: str) -> None:
    """Raises :class:`UnsupportedTrainerVersion` (one line naming the supported range) when the
    installed ``dist`` is outside :data:`SUPPORTED`."""
    msg = problem(dist)
    if msg is not None:
        raise UnsupportedTrainerVersion(msg)


def warn(dist: str) -> bool:
    """Like :func:`require`, but logs the line as an error instead (for code that trainers import
    in every process, where raising would break the trainer itself). Returns whether it is supported."""
    msg = problem(dist)
    if msg is not None:
        logger.error("histospec: %s", msg)
    return msg is None
