"""Transparent huge pages for the index's memory, through glibc's own switch.

A draft step reads a few random cache lines in each of hundreds of groups spread over a gigabyte,
so with 4 KiB pages most reads also miss the TLB. glibc (2.35 and later) backs its allocations with
transparent huge pages when a process starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
(``madvise``; the kernel's THP mode ``madvise`` or ``always`` is enough, no root needed). A process
cannot turn it on for itself once started, so ``HISTOSPEC_HUGE_PAGES=1`` puts the tunable in the
environment of the processes that will hold an index: SGLang's scheduler processes (the plugin
sets it before SGLang starts them), ``histospec-sgl launch-server``'s server, and the
``histospec-sgl`` command itself (it starts again with the tunable).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from histospec_sgl import settings

TUNABLE = "glibc.malloc.hugetlb=1"
#: glibc's first version with the ``glibc.malloc.hugetlb`` tunable.
GLIBC_MIN = (2, 35)


def _glibc() -> tuple[int, int] | None:
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()  # e.g. "glibc 2.36"
    except (AttributeError, ValueError, OSError):
        return None
    if name != "glibc":
        return None
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def supported() -> bool:
    """Whether this process runs on a glibc that knows the huge-page tunable (Linux, glibc >= 2.35)."""
    version = _glibc()
    return sys.platform.startswith("linux") and version is not None and version >= GLIBC_MIN


def requested(env: Mapping[str, str]) -> bool:
    """Whether ``env`` asks for huge pages (``HISTOSPEC_HUGE_PAGES=1``)."""
    return settings.value("HISTOSPEC_HUGE_PAGES", env) == "1"


def has_tunable(env: Mapping[str, str]) -> bool:
    """Whether ``env``'s ``GLIBC_TUNABLES`` turns glibc's huge pages on."""
    return TUNABLE in env.get("GLIBC_TUNABLES", "").split(":")


def add_tunable(env: MutableMapping[str, str]) -> None:
    """Adds the huge-page tunable to ``env``'s ``GLIBC_TUNABLES`` (keeping the others)."""
    if not has_tunable(env):
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES", ""), TUNABLE]))


def _start_environment() -> dict[str, str]:
    """The environment this process started with (what glibc read), not later changes."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def huge_pages() -> bool:
    """Whether this process's allocations are on transparent huge pages: it started with glibc's
    huge-page tunable (``HISTOSPEC_HUGE_PAGES=1`` arranges that) on a glibc that has it."""
    return supported() and has_tunable(_start_environment())


def prepare_children(env: MutableMapping[str, str] | None = None) -> bool:
    """With ``HISTOSPEC_HUGE_PAGES=1`` in ``env`` (default: this process's environment), adds the
    tunable there, so that processes started from here get huge pages; returns whether it did."""
    env = os.environ if env is None else env
    if not (requested(env) and supported()):
        return False
    add_tunable(env)
    return True
