"""Helpers the command line's modules share: argument types, result JSON, the recorded command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.3f}"
    return str(v)


def write_json(path: str, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def command() -> str:
    """The command line as typed, recorded in every result."""
    return "histospec-sgl " + " ".join(sys.argv[1:])


def report(result: dict[str, Any], print_table: Any, json_path: str | None) -> None:
    """Stamps the command into a bench result, prints its table, writes its JSON when asked."""
    result["command"] = command()
    print_table(result)
    if json_path:
        write_json(json_path, result)


def kv(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
        out[k.strip()] = float(v) if any(c in v for c in ".e") else int(v)
    return out


def counts(text: str) -> list[int]:
    """A comma list of ints >= 1 (an argparse type)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma list of ints: {text!r}") from e
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"needs counts >= 1, got {text!r}")
    return out


def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def names(text: str) -> list[str]:
    """A comma list of names; "none" or empty for none."""
    return [] if text.strip() in ("", "none") else [x.strip() for x in text.split(",") if x.strip()]
