"""Readable table and PNG plots for a replay result."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _rows(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    rows = [("ours", result["ours"])]
    rows += [(k, v) for k, v in result["peers"].items()]
    rows += [(k, v) for k, v in result.get("bounds", {}).items()]
    return rows


def print_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    cfg = result["config"]
    con = console()
    title = (
        f"replay {cfg['scenario']} on {cfg['preset'] or cfg['input']}: {cfg['replayed_responses']} responses, "
        f"{cfg['cases']} cases, d={cfg['draft_tokens']}{' chain' if cfg['chain'] else ''}"
    )
    t = Table(title=title)
    costs = cfg["cost_model"]["verify_costs"]
    t.add_column("method")
    t.add_column("tok/step", justify="right")
    t.add_column("ours ×", justify="right")
    t.add_column("coverage", justify="right")
    t.add_column("p10/p50/p90", justify="right")
    t.add_column("speedup @ verify cost " + "/".join(f"{c:g}" for c in costs), justify="right")
    t.add_column("CPU µs/step", justify="right")
    ours_tps = result["ours"]["tokens_per_verify_step"]
    for name, r in _rows(result):
        if r.get("status", "ok") != "ok":
            continue
        tps = r["tokens_per_verify_step"]
        pr = r["per_response_tokens_per_step"]
        t.add_row(
            name,
            f"{tps:.2f}",
            "" if name == "ours" else f"{ours_tps / tps:.2f}",
            f"{r['draft_coverage']:.0%}",
            f"{pr['p10']:.1f}/{pr['p50']:.1f}/{pr['p90']:.1f}",
            "/".join(f"{r['projected_speedup'][f'{c:g}']:.2f}" for c in costs),
            f"{r['draft_us_per_step'] + r['update_us_per_step']:.1f}",
        )
    con.print(t)
    for name, r in _rows(result):
        if r.get("status", "ok") != "ok":
            con.print(f"  {name}: {r['status']} ({r.get('reason', '')})")
    if result.get("bounds"):
        con.print(
            "bound_* rows are oracle ceilings, not drafters: each step they draft the longest prefix of the "
            "logged continuation that occurs in the text the index can see (bound_copy_after_1: right after "
            "an occurrence of the last token)."
        )
    con.print(
        "tokens/verify step = tokens emitted per target forward (accepted + 1); speedup @c assumes verifying "
        f"{cfg['draft_tokens']} nodes costs c decode steps (cost model in the JSON)."
    )


def _save(fig: Any, ax: Any, path: Path, out: list[Path]) -> None:
    import matplotlib.pyplot as plt

    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)


def write_plots(result: dict[str, Any], plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    rows = [(n, r) for n, r in _rows(result) if r.get("status", "ok") == "ok"]
    out: list[Path] = []
    tag = f"{cfg['preset'] or 'custom'}_{cfg['scenario']}"

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(rows)
    for i, (name, r) in enumerate(rows):
        h = r["accepted_length_histogram"]
        total = max(sum(h), 1)
        ax.bar([x + i * width for x in range(len(h))], [v / total for v in h], width=width, label=name)
    ax.set_xlabel("accepted draft tokens per verify step")
    ax.set_ylabel("fraction of verify steps")
    ax.set_title(f"accepted length, {cfg['scenario']} ({cfg['preset'] or 'custom'}, d={cfg['draft_tokens']})")
    _save(fig, ax, plot_dir / f"accepted_hist_{tag}.png", out)

    by = result["ours"]["tokens_per_verify_step_by_step"]
    if len(by) > 1:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, r in rows:
            b = r["tokens_per_verify_step_by_step"]
            xs = sorted(b, key=float)
            ax.plot([float(x) for x in xs], [b[x] for x in xs], marker=".", linestyle="-", label=name)
        ax.set_xlabel("step / epoch of the replayed responses")
        ax.set_ylabel("tokens per verify step")
        ax.set_title(f"tokens per verify step by step, {cfg['scenario']} ({cfg['preset'] or 'custom'})")
        _save(fig, ax, plot_dir / f"tokens_per_step_by_step_{tag}.png", out)
    return out
