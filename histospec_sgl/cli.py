"""The ``histospec-sgl`` command line: offline replay of rollout logs, the draft server, the SGLang
launcher, benchmarks."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from histospec_sgl import hugepages
from histospec_sgl.bench.commands import add_bench
from histospec_sgl.cliutil import add_log_fields, command, floats, kv, log_fields, names, write_json
from histospec_sgl.install import pip_line
from histospec_sgl.settings import parse_size
from histospec_sgl.simulate.cli import add_simulate


def _replay(args: argparse.Namespace) -> int:
    from histospec_sgl.replay.data import ReplayDataError
    from histospec_sgl.replay.report import print_table, write_plots
    from histospec_sgl.replay.run import ReplayOptions, default_peers, run_replay

    try:
        fields = log_fields(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    opts = ReplayOptions(
        preset=args.preset,
        input=Path(args.input) if args.input else None,
        fields=fields,
        data_root=Path(args.data_root) if args.data_root else None,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        scenario=args.scenario,
        draft_tokens=args.draft_tokens,
        chain=args.chain,
        finish=args.finish,
        seed=args.seed,
        max_groups=args.max_groups,
        per_group=args.per_group,
        history_size=args.history_size,
        history_policies=args.history_policies,
        min_step=args.min_step,
        peers=default_peers() if args.peers is None else args.peers,
        bounds=args.bounds,
        draft_config=args.draft_config or {},
        verify_costs=args.verify_cost,
        batch_size=args.batch_size,
        decode_step_ms=args.decode_step_ms,
        progress=not args.no_progress,
    )
    if args.plot_dir:
        # Said before the replay runs, not after it (a long run would end in a traceback).
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"error: --plot needs matplotlib: {pip_line('bench')}", file=sys.stderr)
            return 2
    try:
        result = run_replay(opts, command=command())
    except ReplayDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(result)
    if args.json:
        write_json(args.json, result)
    if args.plot_dir:
        for p in write_plots(result, Path(args.plot_dir)):
            print(f"wrote {p}", file=sys.stderr)
    return 0


def _add_replay(sub: Any) -> None:
    from histospec_sgl.replay.data import PRESETS
    from histospec_sgl.replay.methods import FINISH_MODES
    from histospec_sgl.replay.run import BOUNDS, DEFAULT_VERIFY_COSTS, OPTIONAL_PEERS, PEERS
    from histospec_sgl.replay.scenarios import SCENARIOS

    rp = sub.add_parser(
        "replay",
        help="tokens per verify step and projected speedup on rollout logs (no GPU)",
        description="Simulate speculative decoding with the history index on logged rollouts, next to peers.",
    )
    src = rp.add_argument_group("input")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in dataset (see docs/benchmarks.md)")
    src.add_argument("--data-root", metavar="DIR", help="where the presets' files live (default ../shared/data/rollouts)")
    add_log_fields(src)
    sc = rp.add_argument_group("scenario")
    sc.add_argument("--scenario", choices=SCENARIOS, default="cross-sample")
    sc.add_argument("--draft-tokens", type=int, default=16,
                    help="tree nodes per verify step, root included (default 16: the width of the replay results "
                    "in bench/RESULTS.md; an SGLang engine defaults to 12)")
    sc.add_argument("--chain", action="store_true", help="draft chains instead of trees (ours)")
    sc.add_argument(
        "--finish",
        choices=FINISH_MODES,
        default="keep",
        help="ours: how a finished in-flight sibling becomes history: keep it in the index (the worker "
        "without a draft server), or draft-server (removed once its group is idle, and its response "
        "published back at once, so it counts twice while siblings decode)",
    )
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--max-groups", type=int, help="groups sampled (0 = all; preset default otherwise)")
    sc.add_argument("--per-group", type=int, help="responses replayed per group (0 = all)")
    sc.add_argument("--history-size", type=int, help="cap on history responses per case (0 = all)")
    sc.add_argument("--history-policies", type=int, help="cross-policy: other policies in the history (0 = all)")
    sc.add_argument("--min-step", type=int, help="only steps/iterations >= this")
    sc.add_argument("--peers", type=names, default=None,
                    help=f"comma list of {', '.join(PEERS + OPTIONAL_PEERS)}, or none (default: {', '.join(PEERS)}, "
                    "and the arctic ones where arctic-inference is installed; sglang_ngram_global needs sglang, "
                    "the arctic ones arctic-inference: both are in .venv-sglang)")
    sc.add_argument(
        "--bounds",
        type=names,
        default="none",
        help=f"oracle ceilings to add, comma list of {', '.join(BOUNDS)}, or none (default): the longest "
        "prefix of the logged continuation found in the visible text (after the last token)",
    )
    sc.add_argument("--draft-config", type=kv, help="ours: DraftConfig overrides, e.g. recency=0.5,escape=1")
    cm = rp.add_argument_group("cost model")
    cm.add_argument(
        "--verify-cost",
        type=floats,
        default=list(DEFAULT_VERIFY_COSTS),
        help="cost of verifying d nodes in decode steps, comma list (default 1,1.1,1.25,1.5,2)",
    )
    cm.add_argument("--batch-size", type=int, default=64, help="requests per decode step (CPU draft cost)")
    cm.add_argument("--decode-step-ms", type=float, default=20.0, help="one plain decode step of the batch")
    out = rp.add_argument_group("output")
    out.add_argument("--json", metavar="PATH")
    out.add_argument("--plot", "--plot-dir", dest="plot_dir", metavar="DIR", help="write the plots into DIR")
    out.add_argument("--no-progress", action="store_true")
    rp.set_defaults(func=_replay)


def _draft_server(argv: list[str]) -> int:
    """``histospec-sgl draft-server``: the arguments belong to the server's own parser (the Rust
    ``clap`` definition the ``histospec-draft-server`` binary uses), so both take the same flags."""
    from histospec_sgl import _core

    return int(_core.draft_server_main([DRAFT_SERVER, *argv]))


def _server_options(p: argparse.ArgumentParser, listen: str, where: str = "") -> None:
    """The server options ``ray draft-server`` hands to each shard's server (the flags of
    ``histospec-sgl draft-server``, which the server's own parser defines): address, durability,
    security, retention (``where``: which machine the paths are on)."""
    p.add_argument("--listen", default=listen, help=f"host:port (default {listen}; port 0: any free)")
    p.add_argument("--data-dir", metavar="D", help=f"persist the log and snapshots here{where} (fsync before ack)")
    p.add_argument("--auth-token-file", metavar="F",
                   help=f"require `authorization: Bearer <token in F>`{where}; clients read theirs from "
                   "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE")
    p.add_argument("--tls-cert", metavar="PEM", help=f"serve TLS with this certificate chain{where}")
    p.add_argument("--tls-key", metavar="PEM", help="and this private key")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening beyond loopback without a token (a network you trust)")
    p.add_argument("--max-tokens", type=int, default=0, metavar="N",
                   help="retain at most N prompt+response tokens, evicting the oldest records (0: no limit)")
    p.add_argument("--max-records", type=int, default=0, metavar="N", help="retain at most N records (0: no limit)")
    p.add_argument("--memory-bytes", type=parse_size, default=0, metavar="SIZE",
                   help="hold at most SIZE of encoded records in memory, reading older ones back from --data-dir "
                   "(0: all in memory)")


DRAFT_SERVER = "histospec-sgl draft-server"


def _add_draft_server(sub: Any) -> None:
    # A placeholder for the top-level help: main() hands the arguments to the server's own parser.
    sub.add_parser("draft-server", add_help=False,
                   help="serve history to engines and trainers over gRPC (histospec.v1; see draft-server --help)")


def _ray_draft_server(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError:
        print("error: `histospec-sgl ray` needs Ray (pip install ray)", file=sys.stderr)
        return 2
    from histospec_sgl.integrations import ray_draft_server as rds

    if bool(args.tls_cert) != bool(args.tls_key):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False,
             logging_level="WARNING")
    try:
        if args.status:
            running = rds.lookup(args.name, args.namespace)
            print(running if running else f"no actor {args.namespace}/{args.name}")
            return 0 if running else 1
        if args.stop:
            found = rds.stop(args.name, args.namespace)
            print(f"stopped {args.namespace}/{args.name}" if found else f"no actor {args.namespace}/{args.name}")
            return 0 if found else 1
        extra = []
        if args.max_tokens:
            extra += ["--max-tokens", str(args.max_tokens)]
        if args.max_records:
            extra += ["--max-records", str(args.max_records)]
        if args.memory_bytes:
            extra += ["--memory-bytes", str(args.memory_bytes)]
        _, address = rds.get_or_create(name=args.name, namespace=args.namespace, listen=args.listen,
                                       data_dir=args.data_dir, extra=extra, log=args.log,
                                       token_file=args.auth_token_file, tls_cert=args.tls_cert,
                                       tls_key=args.tls_key, insecure=args.insecure, shards=args.shards)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(address)
    print(f"# engines and trainers: HISTOSPEC_DRAFT_SERVER_ACTOR={args.namespace}/{args.name} and the setup hook "
          "histospec_sgl.integrations.ray_setup.setup in the job's runtime env: they get the address and the "
          "token from the actor", file=sys.stderr)
    return 0


def _add_ray(sub: Any) -> None:
    rp = sub.add_parser("ray", help="histospec-sgl on a Ray cluster")
    rsub = rp.add_subparsers(dest="ray", required=True)
    rd = rsub.add_parser(
        "draft-server", help="start (or find) the draft server as a detached, named actor on the head node",
        description="Starts the draft server as a detached Ray actor pinned to the head node (num_cpus=0) and "
        "prints its address; a second call prints the running one's. It requires a token unless --insecure: "
        "the one in --auth-token-file, else one made when the actor is created (kept in --data-dir), the same "
        "after every restart of the actor or its server. Engines and trainers "
        "get the address and token through HISTOSPEC_DRAFT_SERVER_ACTOR=ns/name with the setup hook "
        "histospec_sgl.integrations.ray_setup.setup in the job's runtime env.")
    rd.add_argument("--address", default="auto", help="Ray cluster to connect to (default auto: the running one)")
    rd.add_argument("--name", default="histospec-draft-server")
    rd.add_argument("--namespace", default="histospec")
    _server_options(rd, "0.0.0.0:50061", " (on the head node)")
    rd.add_argument("--log", metavar="F", help="the server's stderr, on the head node")
    rd.add_argument("--shards", type=int, default=None, metavar="N",
                    help="run the server as N shards (default 1), each its own actor, process, port (port + i for "
                    "a fixed --listen port) and --data-dir/shard-i; a group's records live on shard key mod N and "
                    "clients get the comma list of addresses. A running server asked for other --shards or "
                    "--data-dir refuses")
    rd.add_argument("--stop", action="store_true", help="stop the running actor instead")
    rd.add_argument("--status", action="store_true",
                    help="print the running actor's address (exit 0), or that there is none (exit 1); start nothing")
    rd.set_defaults(func=_ray_draft_server)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="histospec-sgl", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _add_replay(sub)
    _add_draft_server(sub)
    _add_ray(sub)
    add_simulate(sub)
    sub.add_parser("launch-server", add_help=False,
                   help="start SGLang with --speculative-algorithm HISTORY (see launch-server --help)")
    add_bench(sub)
    return ap


def reference() -> str:
    """docs/cli.md's command reference: every command's ``--help``, as its parser prints it at 100
    columns (tests/docs/test_docs.py keeps docs/cli.md equal to it)."""
    from histospec_sgl.plugin.launch import _parser as launch_parser

    def walk(p: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(path, p)]
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found += walk(child, f"{path} {name}")
        return found

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parts = []
        for path, p in [*walk(build_parser(), "histospec-sgl"), ("histospec-sgl launch-server", launch_parser())]:
            if path == "histospec-sgl launch-server" and not p.description:
                continue  # the placeholder subcommand; its real parser comes last
            if path == DRAFT_SERVER:
                from histospec_sgl import _core

                text = _core.draft_server_help(DRAFT_SERVER)
            else:
                p.prog = path
                text = p.format_help()
            parts.append(f"## `{path}`\n\n```text\n{text.rstrip()}\n```\n")
        return "\n".join(parts)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def stale_install_note(installed: Path, checkout: Path) -> str | None:
    """A warning when ``installed`` (the imported package's directory) is an installed copy and
    ``checkout`` holds a source tree (``histospec_sgl/``, ``rust/``) with a file newer than the
    installed extension: the run measures an older build than the one in front of the user
    (``.venv-sglang`` keeps its wheel until ``scripts/setup_sglang_env.sh`` runs again)."""
    src = checkout / "histospec_sgl"
    if not (src / "__init__.py").is_file() or src.resolve() == installed.resolve():
        return None
    built = [p.stat().st_mtime for p in installed.glob("_core*.so")] or [(installed / "__init__.py").stat().st_mtime]
    newest, path = max(((p.stat().st_mtime, p) for p in [*src.rglob("*.py"), *(checkout / "rust").rglob("*.rs")]),
                       default=(0.0, None))
    if path is None or newest <= min(built):
        return None
    return (f"note: this runs the histospec_sgl installed in {installed}, but {path.relative_to(checkout)} "
            "in this checkout is newer: rebuild it (bash scripts/setup_env.sh, or scripts/setup_sglang_env.sh "
            "for .venv-sglang) to measure the current code")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "launch-server":
        # Its unknown arguments belong to SGLang: parsed there, not by this parser.
        from histospec_sgl.plugin.launch import main as launch_server

        return launch_server(argv[1:])
    if argv and argv[0] == "draft-server":
        return _draft_server(argv[1:])
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    if hugepages.prepare_children(env) and not hugepages.huge_pages():
        # glibc reads its huge-page switch at process start: start again with it.
        os.execve(sys.executable, [sys.executable, "-m", "histospec_sgl.cli", *argv], env)
    if argv and argv[0] in ("bench", "replay"):
        import histospec_sgl

        note = stale_install_note(Path(histospec_sgl.__file__).parent, Path.cwd())
        if note:
            print(note, file=sys.stderr)
    if argv and argv[0] == "bench":
        # SIGTERM (a job's timeout, a scheduler's stop) ends a benchmark through SystemExit, so that
        # its finally blocks run: the servers it started are stopped and its temporary files removed.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return int(args.func(args))
    except ModuleNotFoundError as e:
        hint = missing_module_hint(e.name)
        if hint is None:
            raise
        print(f"error: {hint}", file=sys.stderr)
        return 2


#: Optional packages a command may need, and how to get them.
BENCH_EXTRA = ("tokenizers", "matplotlib", "psutil", "rich", "tqdm")
ENGINE = ("torch", "sglang", "transformers", "sgl_kernel")


def missing_module_hint(name: str | None) -> str | None:
    """One line naming what to install for a missing optional module (None: not an optional one)."""
    root = (name or "").split(".")[0]
    if root in BENCH_EXTRA:
        return f"this command needs {root}: {pip_line('bench')}"
    if root in ENGINE:
        return (f"this command needs SGLang and torch ({root} is missing): pip install sglang, or on a machine "
                "without a GPU bash scripts/setup_sglang_env.sh and run .venv-sglang/bin/histospec-sgl")
    return None


if __name__ == "__main__":
    sys.exit(main())
