"""The ``histospec-sgl`` command line: benchmarks (and, in later releases, replay and servers)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.3f}"
    return str(v)


def _print_index(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from histospec_sgl.bench.index_bench import TARGETS

    con = Console()
    t = Table(title="histospec-sgl bench index (one thread)")
    t.add_column("metric")
    t.add_column("ours", justify="right")
    t.add_column("target", justify="right")
    t.add_column("met", justify="center")
    for k, v in result["ours"].items():
        tgt = TARGETS.get(k)
        met = ""
        if tgt:
            op, x = tgt
            met = "yes" if (v >= x if op == ">=" else v <= x) else "no"
        t.add_row(k, _fmt(v), f"{tgt[0]} {_fmt(tgt[1])}" if tgt else "", met)
    con.print(t)
    p = Table(title="peers (same run)")
    p.add_column("peer")
    p.add_column("status")
    for name, info in result["peers"].items():
        p.add_row(name, info.get("status", "") + (f": {info['reason']}" if "reason" in info else ""))
    con.print(p)


def _bench_index(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import index_bench

    def progress(msg: str) -> None:
        print(f"[bench index] {msg}", file=sys.stderr, flush=True)

    result = index_bench.run(
        workloads=[w.strip().upper() for w in args.workloads.split(",") if w.strip()],
        latency_steps=args.latency_steps,
        acc_prompts=args.acc_prompts,
        progress=progress,
    )
    result["command"] = "histospec-sgl " + " ".join(sys.argv[1:])
    _print_index(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="histospec-sgl", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bi = bsub.add_parser("index", help="index ingest, memory, batch draft latency and acceptance (W1/W2)")
    bi.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bi.add_argument("--workloads", default="W1,W2", help="comma-separated: W1, W2 (default both)")
    bi.add_argument("--latency-steps", type=int, default=100)
    bi.add_argument("--acc-prompts", type=int, default=64, help="prompts replayed for acceptance")
    bi.set_defaults(func=_bench_index)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
