"""The ``histospec-sgl`` command line: offline replay of rollout logs, the draft server, the SGLang
launcher, benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from histospec_sgl import hugepages


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.3f}"
    return str(v)


def _write_json(path: str, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def _command() -> str:
    """The command line as typed, recorded in every result."""
    return "histospec-sgl " + " ".join(sys.argv[1:])


def _report(result: dict[str, Any], print_table: Any, json_path: str | None) -> None:
    """Stamps the command into a bench result, prints its table, writes its JSON when asked."""
    result["command"] = _command()
    print_table(result)
    if json_path:
        _write_json(json_path, result)


def _print_index(result: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.bench.index_bench import TARGETS
    from histospec_sgl.console import console

    con = console()
    t = Table(title="histospec-sgl bench index (one thread unless *_threaded)")
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
    measured = [n for n, i in result["peers"].items() if i.get("status") == "ok"]
    for name, info in result["peers"].items():
        p.add_row(name, info.get("status", "") + (f": {info['reason']}" if "reason" in info else ""))
    con.print(p)
    if measured:
        m = Table(title="ours and peers side by side (W1 unless noted)")
        m.add_column("metric")
        m.add_column("ours", justify="right")
        for n in measured:
            m.add_column(n, justify="right")
        for k, v in result["ours"].items():
            m.add_row(k, _fmt(v), *(_fmt(result["peers"][n][k]) if k in result["peers"][n] else "" for n in measured))
        con.print(m)


def _bench_index(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import index_bench

    def progress(msg: str) -> None:
        print(f"[bench index] {msg}", file=sys.stderr, flush=True)

    result = index_bench.run(
        workloads=[w.strip().upper() for w in args.workloads.split(",") if w.strip()],
        latency_steps=args.latency_steps,
        acc_prompts=args.acc_prompts,
        progress=progress,
        threads=args.threads,
    )
    _report(result, _print_index, args.json)
    return 0


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {name} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: {name} takes integers >= 1, got {text!r}")
    return values


def _bench_lengths(args: argparse.Namespace) -> int:
    from histospec_sgl.control import run
    from histospec_sgl.replay.data import ReplayDataError

    try:
        r = run.lengths([p.strip() for p in args.presets.split(",") if p.strip()],
                        Path(args.data_root) if args.data_root else None,
                        Path(args.tokenizer) if args.tokenizer else None)
    except ReplayDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(r, run.print_lengths, args.json)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from histospec_sgl.control import run
    from histospec_sgl.replay.data import ReplayDataError

    try:
        r = run.run(args.preset, Path(args.data_root) if args.data_root else None,
                    Path(args.tokenizer) if args.tokenizer else None, args.profile, args.groups,
                    _ints(args.max_running, "--max-running"), _ints(args.widths, "--widths"), args.fixed_width,
                    args.history_policies, args.seed, args.plot)
    except (ReplayDataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(r, run.print_simulation, args.json)
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _add_simulate(sub: Any) -> None:
    sp = sub.add_parser(
        "simulate",
        help="a whole RL rollout step offline: makespan, tail and tokens/s under scheduling and speculation policies",
        description="Replays B prompts x n samples of a rollout log on an engine with a KV budget and a step-cost "
        "profile; acceptance per request-step comes from the real index drafting on the logged tokens. Policies: "
        "baseline (FCFS, plain decoding), history_fixed, history_cost_model, length_first, full. Figures are "
        "simulated, on the named profile.",
    )
    sp.add_argument("--preset", default="grpo", help="grpo (default) or ei: logs with several policies per prompt")
    sp.add_argument("--profile", default="h100-8b-analytic",
                    help="an analytic profile by name (h100-8b-analytic) or a measured profile JSON")
    sp.add_argument("--groups", type=int, default=32, help="prompts in the step (default 32, slime's GRPO batch)")
    sp.add_argument("--max-running", default="32,64,128,256",
                    help="KV budgets to simulate, comma-separated; the first is the headline (default 32,64,128,256)")
    sp.add_argument("--widths", default="4,8,12,16", help="verify widths the cost model may pick (default 4,8,12,16)")
    sp.add_argument("--fixed-width", type=int, default=12, help="history_fixed's width (default 12, NGRAM's default)")
    sp.add_argument("--history-policies", type=int, default=2,
                    help="other policies whose responses to the prompt form its history (default 2)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--data-root", metavar="DIR", help="where the presets' files live (default ../shared/data/rollouts)")
    sp.add_argument("--tokenizer", metavar="PATH", help="tokenizers tokenizer.json (default: Qwen3 beside the data)")
    sp.add_argument("--json", metavar="PATH", help="write the result as JSON")
    sp.add_argument("--plot", metavar="PNG", help="write the timeline of the first KV budget")
    sp.set_defaults(func=_simulate)


def _bench_specrl(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import specrl_bench
    from histospec_sgl.specrl import SpecRLError

    try:
        r = specrl_bench.run(
            lenience=args.lenience or specrl_bench.DEFAULT_LENIENCE,
            vocab=args.vocab,
            length=args.length,
            divergence=args.divergence,
            seed=args.seed,
            samples=args.samples,
        )
    except SpecRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(r, specrl_bench.print_table, args.json)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        specrl_bench.plot(r, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _bench_worker(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import worker_bench

    def progress(msg: str) -> None:
        print(f"[bench worker] {msg}", file=sys.stderr, flush=True)

    if args.groups < 1 or args.steps < 1 or not 2 <= args.draft_tokens <= 64:
        print("error: --groups and --steps need values >= 1, --draft-tokens one in 2..64", file=sys.stderr)
        return 2
    if not 0 < args.warm < 1900:
        print("error: --warm must be in 1..1899 (W1 responses have 2000 tokens)", file=sys.stderr)
        return 2
    if not 1 <= args.threads <= 64:
        print("error: --threads must be in 1..64", file=sys.stderr)
        return 2
    r = worker_bench.run(args.batch_sizes, groups=args.groups, d=args.draft_tokens, warm=args.warm, steps=args.steps,
                         progress=progress, threads=args.threads)
    _report(r, worker_bench.print_table, args.json)
    return 0


def _bench_sync(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import sync_bench

    def progress(msg: str) -> None:
        print(f"[bench sync] {msg}", file=sys.stderr, flush=True)

    r = sync_bench.run(
        prompts=args.prompts, samples=args.samples, tokens=args.tokens, prompt_tokens=args.prompt_tokens,
        vocab=args.vocab, mutation=args.mutation, replicas=args.replicas, batch_records=args.batch_records,
        durable=args.durable, seed=args.seed, progress=progress,
    )
    _report(r, sync_bench.print_table, args.json)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import engine_bench

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        r = engine_bench.run(model=args.model, methods=tuple(args.methods.split(",")),
                             batch_sizes=tuple(args.batch_sizes), temperatures=tuple(args.temperatures),
                             siblings=args.siblings, max_new_tokens=args.max_new_tokens,
                             draft_tokens=args.draft_tokens, device=args.device, python=args.python,
                             switch_off=args.switch_off, repeats=args.repeats, log=progress,
                             log_dir=args.log_dir)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(r, engine_bench.print_table, args.json)
    return 0


def _kv(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
        out[k.strip()] = float(v) if any(c in v for c in ".e") else int(v)
    return out


def _counts(text: str) -> list[int]:
    """A comma list of ints >= 1 (an argparse type)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma list of ints: {text!r}") from e
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"needs counts >= 1, got {text!r}")
    return out


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _names(text: str) -> list[str]:
    """A comma list of names; "none" or empty for none."""
    return [] if text.strip() in ("", "none") else [x.strip() for x in text.split(",") if x.strip()]


def _replay(args: argparse.Namespace) -> int:
    from histospec_sgl.replay.data import FieldMap, ReplayDataError
    from histospec_sgl.replay.report import print_table, write_plots
    from histospec_sgl.replay.run import ReplayOptions, default_peers, run_replay

    fields = None
    if args.input:
        if not (args.prompt_field and args.response_field):
            print("error: --input needs --prompt-field and --response-field", file=sys.stderr)
            return 2
        fields = FieldMap(
            prompt=args.prompt_field,
            response=args.response_field,
            group=args.group_field,
            step=args.step_field or args.epoch_field,
            sample=args.sample_field,
            policy=args.policy_field,
            token_ids=args.token_ids,
        )
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
            print("error: --plot-dir needs matplotlib: pip install 'histospec-sgl[bench]'", file=sys.stderr)
            return 2
    try:
        result = run_replay(opts, command=_command())
    except ReplayDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(result)
    if args.json:
        _write_json(args.json, result)
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
    src.add_argument("--input", metavar="PATH", help="a JSONL or JSONL.gz log (with the --*-field mapping)")
    src.add_argument("--data-root", metavar="DIR", help="where the presets' files live (default ../shared/data/rollouts)")
    src.add_argument("--tokenizer", metavar="PATH", help="tokenizers tokenizer.json (default: Qwen3 beside the data)")
    src.add_argument("--prompt-field")
    src.add_argument("--response-field", help="text, or a list of texts (several samples)")
    src.add_argument("--group-field", help="prompt group id (default: the prompt itself)")
    src.add_argument("--step-field", help="training step / iteration of the sample")
    src.add_argument("--epoch-field", help="alias of --step-field")
    src.add_argument("--sample-field")
    src.add_argument("--policy-field", help="run / checkpoint id (cross-policy)")
    src.add_argument("--token-ids", action="store_true", help="prompt and response fields hold token-id lists")
    sc = rp.add_argument_group("scenario")
    sc.add_argument("--scenario", choices=SCENARIOS, default="cross-sample")
    sc.add_argument("--draft-tokens", type=int, default=16, help="tree nodes per verify step, root included")
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
    sc.add_argument("--peers", type=_names, default=None,
                    help=f"comma list of {', '.join(PEERS + OPTIONAL_PEERS)}, or none (default: {', '.join(PEERS)}, "
                    "and the arctic ones where arctic-inference is installed; sglang_ngram_global needs sglang, "
                    "the arctic ones arctic-inference: both are in .venv-sglang)")
    sc.add_argument(
        "--bounds",
        type=_names,
        default="none",
        help=f"oracle ceilings to add, comma list of {', '.join(BOUNDS)}, or none (default): the longest "
        "prefix of the logged continuation found in the visible text (after the last token)",
    )
    sc.add_argument("--draft-config", type=_kv, help="ours: DraftConfig overrides, e.g. recency=0.5,escape=1")
    cm = rp.add_argument_group("cost model")
    cm.add_argument(
        "--verify-cost",
        type=_floats,
        default=list(DEFAULT_VERIFY_COSTS),
        help="cost of verifying d nodes in decode steps, comma list (default 1,1.1,1.25,1.5,2)",
    )
    cm.add_argument("--batch-size", type=int, default=64, help="requests per decode step (CPU draft cost)")
    cm.add_argument("--decode-step-ms", type=float, default=20.0, help="one plain decode step of the batch")
    out = rp.add_argument_group("output")
    out.add_argument("--json", metavar="PATH")
    out.add_argument("--plot-dir", metavar="DIR")
    out.add_argument("--no-progress", action="store_true")
    rp.set_defaults(func=_replay)


def _draft_server(args: argparse.Namespace) -> int:
    import ipaddress

    from histospec_sgl import _core

    token = None
    if args.auth_token_file:
        try:
            token = Path(args.auth_token_file).read_text().strip()
        except OSError as e:
            print(f"error: --auth-token-file: {e}", file=sys.stderr)
            return 2
        if not token:
            print(f"error: --auth-token-file {args.auth_token_file} is empty", file=sys.stderr)
            return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    host = args.listen.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and token is None:
        print(f"warning: listening on {args.listen} without --auth-token-file: anyone who can reach it can "
              "publish history", file=sys.stderr)
    try:
        _core.run_draft_server(
            args.listen,
            auth_token=token,
            data_dir=args.data_dir,
            max_tokens=args.max_tokens,
            max_records=args.max_records,
            max_message_bytes=args.max_message_bytes,
            max_tokens_per_record=args.max_tokens_per_record,
            snapshot_every_bytes=args.snapshot_every_bytes,
            subscriber_buffer=args.subscriber_buffer,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _add_draft_server(sub: Any) -> None:
    ds = sub.add_parser(
        "draft-server",
        help="serve history to index replicas over gRPC (histospec.v1)",
        description="The draft server: trainers and engines publish finished rollouts, index replicas "
        "subscribe and converge to the same history. Stops gracefully on SIGTERM/SIGINT.",
    )
    ds.add_argument("--listen", default="127.0.0.1:50061", help="host:port (default loopback; port 0: any free)")
    ds.add_argument("--auth-token-file", metavar="F", help="require `authorization: Bearer <token in F>`")
    ds.add_argument("--data-dir", metavar="D", help="persist the log and snapshots here (fsync before ack)")
    ds.add_argument("--max-tokens", type=int, default=0, metavar="N",
                    help="retain at most N prompt+response tokens, evicting the oldest records (0: no limit)")
    ds.add_argument("--max-records", type=int, default=0, metavar="N", help="retain at most N records (0: no limit)")
    ds.add_argument("--max-message-bytes", type=int, default=64 << 20, help="largest gRPC message (default 64 MiB)")
    ds.add_argument("--max-tokens-per-record", type=int, default=1 << 20)
    ds.add_argument("--snapshot-every-bytes", type=int, default=256 << 20,
                    help="compact the log into a snapshot after this much log (default 256 MiB)")
    ds.add_argument("--subscriber-buffer", type=int, default=8, help="messages buffered per subscriber")
    ds.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    ds.add_argument("--tls-key", metavar="PEM", help="and this private key")
    ds.set_defaults(func=_draft_server)


def _ray_draft_server(args: argparse.Namespace) -> int:
    try:
        import ray
    except ImportError:
        print("error: `histospec-sgl ray` needs Ray (pip install ray)", file=sys.stderr)
        return 2
    from histospec_sgl.integrations import ray_draft_server as rds

    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False,
             logging_level="WARNING")
    try:
        if args.stop:
            found = rds.stop(args.name, args.namespace)
            print(f"stopped {args.namespace}/{args.name}" if found else f"no actor {args.namespace}/{args.name}")
            return 0 if found else 1
        extra = []
        if args.auth_token_file:
            extra += ["--auth-token-file", args.auth_token_file]
        if args.max_tokens:
            extra += ["--max-tokens", str(args.max_tokens)]
        _, address = rds.get_or_create(name=args.name, namespace=args.namespace, listen=args.listen,
                                       data_dir=args.data_dir, extra=extra, log=args.log)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(address)
    print(f"# engines: HISTOSPEC_DRAFT_SERVER={address} (or HISTOSPEC_DRAFT_SERVER_ACTOR={args.namespace}/{args.name}) "
          "in the job's runtime_env env_vars", file=sys.stderr)
    return 0


def _add_ray(sub: Any) -> None:
    rp = sub.add_parser("ray", help="histospec-sgl on a Ray cluster")
    rsub = rp.add_subparsers(dest="ray", required=True)
    rd = rsub.add_parser(
        "draft-server", help="start (or find) the draft server as a detached, named actor on the head node",
        description="Starts the draft server as a detached Ray actor pinned to the head node (num_cpus=0) and "
        "prints its address; a second call prints the running one's. Engines find it through "
        "HISTOSPEC_DRAFT_SERVER=<address> in the job's runtime env, or HISTOSPEC_DRAFT_SERVER_ACTOR=ns/name.")
    rd.add_argument("--address", default="auto", help="Ray cluster to connect to (default auto: the running one)")
    rd.add_argument("--name", default="histospec-draft-server")
    rd.add_argument("--namespace", default="histospec")
    rd.add_argument("--listen", default="0.0.0.0:50061", help="host:port the server binds on the head node")
    rd.add_argument("--data-dir", metavar="D", help="durable history on the head node (recommended)")
    rd.add_argument("--auth-token-file", metavar="F", help="a token file on the head node")
    rd.add_argument("--max-tokens", type=int, default=0, help="retention, as for draft-server")
    rd.add_argument("--log", metavar="F", help="the server's stderr, on the head node")
    rd.add_argument("--stop", action="store_true", help="stop the running actor instead")
    rd.set_defaults(func=_ray_draft_server)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="histospec-sgl", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _add_replay(sub)
    _add_draft_server(sub)
    _add_ray(sub)
    _add_simulate(sub)
    sub.add_parser("launch-server", add_help=False,
                   help="start SGLang with --speculative-algorithm HISTORY (see launch-server --help)")
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bl = bsub.add_parser("lengths", help="response length predicted from history vs actual (Spearman) on the logs")
    bl.add_argument("--presets", default="grpo,ei,humaneval", help="comma-separated logs (default all three)")
    bl.add_argument("--data-root", metavar="DIR", help="where the presets' files live (default ../shared/data/rollouts)")
    bl.add_argument("--tokenizer", metavar="PATH", help="tokenizers tokenizer.json (default: Qwen3 beside the data)")
    bl.add_argument("--json", metavar="PATH", help="write the result as JSON")
    bl.set_defaults(func=_bench_lengths)
    bi = bsub.add_parser("index", help="index ingest, memory, batch draft latency and acceptance (W1/W2)")
    bi.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bi.add_argument("--workloads", default="W1,W2", help="comma-separated: W1, W2 (default both)")
    bi.add_argument("--latency-steps", type=int, default=100)
    bi.add_argument("--acc-prompts", type=int, default=64, help="prompts replayed for acceptance")
    bi.add_argument(
        "--threads",
        type=int,
        default=1,
        help="also time the batch calls split across this many threads (*_threaded keys); "
        "the targets are for one thread",
    )
    bi.set_defaults(func=_bench_index)
    bs = bsub.add_parser("specrl", help="SPEC-RL lenience trade-off on a synthetic policy pair")
    bs.add_argument("--json", metavar="PATH")
    bs.add_argument("--plot", metavar="PNG", help="write the trade-off plot")
    bs.add_argument("--lenience", type=_floats, help="comma list of ℓ >= 1 (inf allowed); default 1,e^.15,e^.3,e^.5,e,e^2,inf")
    bs.add_argument("--vocab", type=int, default=4)
    bs.add_argument("--length", type=int, default=6)
    bs.add_argument("--divergence", type=float, default=0.5, help="std of the old policy's logit noise")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--samples", type=int, default=100_000)
    bs.set_defaults(func=_bench_specrl)
    bw = bsub.add_parser("worker", help="host time the SGLang worker adds per decode step (context sync + draft)")
    bw.add_argument("--json", metavar="PATH")
    bw.add_argument("--batch-sizes", type=_counts, default=[32, 128, 256], help="comma list of decode batch sizes")
    bw.add_argument("--groups", type=int, default=64, help="prompts (groups); siblings per group = batch / groups")
    bw.add_argument("--draft-tokens", type=int, default=12, help="d, the verify width (SGLang's default 12)")
    bw.add_argument("--warm", type=int, default=1000, help="response tokens already decoded when timing starts")
    bw.add_argument("--steps", type=int, default=60)
    bw.add_argument("--threads", type=int, default=1,
                    help="the index's threads (HISTOSPEC_THREADS; the worker's default is min(4, cores))")
    bw.set_defaults(func=_bench_worker)
    by = bsub.add_parser("sync", help="draft server: publish throughput, time until 1/2/4 replicas applied a step")
    by.add_argument("--json", metavar="PATH")
    by.add_argument("--prompts", type=int, default=256)
    by.add_argument("--samples", type=int, default=16)
    by.add_argument("--tokens", type=int, default=2000, help="response tokens")
    by.add_argument("--prompt-tokens", type=int, default=200)
    by.add_argument("--vocab", type=int, default=150_000)
    by.add_argument("--mutation", type=float, default=0.2, help="share of a response resampled from its group's base")
    by.add_argument("--replicas", type=_counts, default=[1, 2, 4], help="comma list of replica counts, one run each")
    by.add_argument("--batch-records", type=int, default=256, help="records per Publish call")
    by.add_argument("--durable", action="store_true", help="give the server a data dir (fsync before ack)")
    by.add_argument("--seed", type=int, default=0)
    by.set_defaults(func=_bench_sync)
    be = bsub.add_parser("engine", help="plain decoding, NGRAM and HISTORY on a real SGLang server (CPU or GPU)")
    be.add_argument("--json", metavar="PATH")
    be.add_argument("--model", default="rhyme",
                    help="rhyme (a small Llama trained on the shipped HumanEval completions, built and cached on "
                    "first use), random (random weights), or a model directory")
    be.add_argument("--methods", default="plain,ngram,history,history_switchoff",
                    help="comma list of plain, ngram, history, history_switchoff")
    be.add_argument("--batch-sizes", type=_counts, default=[1, 4, 16, 64])
    be.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
    be.add_argument("--siblings", type=int, default=8, help="samples per prompt in the sibling rows (sampled only)")
    be.add_argument("--max-new-tokens", type=int, default=128)
    be.add_argument("--draft-tokens", type=int, default=8, help="d, the verify width of NGRAM and HISTORY")
    be.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: SGLang's torch_native backend with the checkout's CPU stand-ins (tests/_cpu_engine); "
                    "cuda: FlashInfer and CUDA graphs")
    be.add_argument("--python", help="the interpreter that has SGLang (default: this one)")
    be.add_argument("--switch-off", type=_kv, metavar="K=V,...",
                    help="history_switchoff's HISTOSPEC_* settings (default HISTOSPEC_MIN_ACCEPT=1.0,"
                    "HISTOSPEC_NARROW_VERIFY=1)")
    be.add_argument("--repeats", type=int, default=1,
                    help="run every row this many times (fresh groups each time) and report the medians")
    be.add_argument("--log-dir", help="keep each server's log here")
    be.set_defaults(func=_bench_engine)
    return ap


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "launch-server":
        # Its unknown arguments belong to SGLang: parsed there, not by this parser.
        from histospec_sgl.plugin.launch import main as launch_server

        return launch_server(argv[1:])
    args = build_parser().parse_args(argv)
    if hugepages.requested(os.environ) and hugepages.supported() and not hugepages.huge_pages():
        # glibc reads its huge-page switch at process start: start again with it.
        env = dict(os.environ)
        hugepages.add_tunable(env)
        os.execve(sys.executable, [sys.executable, "-m", "histospec_sgl.cli", *argv], env)
    if argv and argv[0] in ("bench", "replay"):
        import histospec_sgl

        note = stale_install_note(Path(histospec_sgl.__file__).parent, Path.cwd())
        if note:
            print(note, file=sys.stderr)
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
        return f"this command needs {root}: pip install 'histospec-sgl[bench]'"
    if root in ENGINE:
        return (f"this command needs SGLang and torch ({root} is missing): pip install sglang, or on a machine "
                "without a GPU bash scripts/setup_sglang_env.sh and run .venv-sglang/bin/histospec-sgl")
    return None


if __name__ == "__main__":
    sys.exit(main())
