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


def add_log_fields(group: Any) -> None:
    """A rollout log's field options (``--input`` with its mapping), for ``replay`` and ``simulate``."""
    group.add_argument("--input", metavar="PATH", help="a JSONL or JSONL.gz log (with the --*-field mapping)")
    group.add_argument("--tokenizer", metavar="PATH",
                       help="tokenizers tokenizer.json for a text log (default: Qwen3 beside the data)")
    group.add_argument("--prompt-field")
    group.add_argument("--response-field", help="text, or a list of texts (several samples)")
    group.add_argument("--group-field", help="prompt group id (default: the prompt itself)")
    group.add_argument("--step-field", help="training step / iteration of the sample")
    group.add_argument("--epoch-field", help="alias of --step-field")
    group.add_argument("--sample-field")
    group.add_argument("--policy-field", help="run / checkpoint id (cross-policy)")
    group.add_argument("--token-ids", action="store_true", help="prompt and response fields hold token-id lists")


def log_fields(args: argparse.Namespace) -> Any:
    """The :class:`~histospec_sgl.replay.data.FieldMap` of ``--input``'s options (None without
    ``--input``). Raises ValueError when the prompt or response field is missing."""
    from histospec_sgl.replay.data import FieldMap

    if not args.input:
        return None
    if not (args.prompt_field and args.response_field):
        raise ValueError("--input needs --prompt-field and --response-field")
    return FieldMap(prompt=args.prompt_field, response=args.response_field, group=args.group_field,
                    step=args.step_field or args.epoch_field, sample=args.sample_field, policy=args.policy_field,
                    token_ids=args.token_ids)
