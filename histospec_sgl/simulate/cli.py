"""The ``histospec-sgl simulate`` command: its arguments, and the run or the check it starts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from histospec_sgl.cliutil import add_log_fields, counts, log_fields, report


def _simulate(args: argparse.Namespace) -> int:
    import json

    from histospec_sgl.replay.data import ReplayDataError
    from histospec_sgl.simulate import run

    if args.check:
        try:
            r = run.check(json.loads(Path(args.check).read_text()), Path(args.data_root) if args.data_root else None)
        except (ReplayDataError, ValueError, KeyError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        report(r, run.print_check, args.json)
        return 0
    try:
        fields = log_fields(args)
        preset = args.preset or (None if args.input else "grpo")
        r = run.run(preset, Path(args.data_root) if args.data_root else None,
                    Path(args.tokenizer) if args.tokenizer else None, args.profile, args.groups,
                    args.max_running, args.widths, args.fixed_width,
                    args.history_policies, args.seed, args.plot, args.steps, args.engines, args.step_kind,
                    not args.no_siblings, Path(args.input) if args.input else None, fields, args.per_group)
    except (ReplayDataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(r, run.print_simulation, args.json)
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def add_simulate(sub: Any) -> None:
    """``histospec-sgl simulate``."""
    sp = sub.add_parser(
        "simulate",
        help="a whole RL rollout step offline: makespan, tail and tokens/s under scheduling and speculation policies",
        description="Replays B prompts x n samples of a rollout log on an engine with a KV budget and a step-cost "
        "profile; acceptance per request-step comes from the real index drafting on the logged tokens. Policies: "
        "baseline (FCFS, plain decoding), history_fixed, history_cost_model, length_first, full. Figures are "
        "simulated, on the named profile.",
    )
    from histospec_sgl.replay.data import PRESETS

    src = sp.add_argument_group("input (a preset, or your own log with the replay's field options)")
    src.add_argument("--preset", choices=sorted(PRESETS),
                     help="a built-in log (default grpo; humaneval-sample ships with the package)")
    src.add_argument("--data-root", metavar="DIR", help="where the presets' files live (default ../shared/data/rollouts)")
    add_log_fields(src)
    sp.add_argument("--profile", default="h100-8b-analytic",
                    help="an analytic profile by name (h100-8b-analytic) or a measured profile JSON")
    sp.add_argument("--groups", type=int, default=32, help="prompts in the step (default 32, slime's GRPO batch)")
    sp.add_argument("--max-running", type=counts, default=[32, 64, 128, 256],
                    help="KV budgets to simulate, comma-separated; the first is the headline (default 32,64,128,256)")
    sp.add_argument("--widths", type=counts, default=[4, 8, 12, 16], help="verify widths the cost model may pick (default 4,8,12,16)")
    sp.add_argument("--fixed-width", type=int, default=12, help="history_fixed's width (default 12, NGRAM's default)")
    sp.add_argument("--history-policies", type=int, default=2,
                    help="a group's history: the responses of this many other policies at the same step (a log of "
                    "several policies, the presets), or of the prompt's latest earlier steps (a log of one "
                    "policy with --step-field); 0: siblings only (default 2)")
    sp.add_argument("--per-group", type=int, default=0,
                    help="samples per group decoded in the step (default 0: every sample the log has)")
    sp.add_argument("--seed", type=int, default=0, help="the first step's seed (default 0)")
    sp.add_argument("--steps", type=int, default=5,
                    help="steps simulated (seeds seed, seed+1, ...); figures are medians with ranges (default 5)")
    sp.add_argument("--step-kind", choices=("one-policy", "mixed"), default="one-policy",
                    help="one-policy: consecutive logged steps of one policy, as a trainer's step (default); "
                         "mixed: each group's policy drawn at random")
    sp.add_argument("--no-siblings", action="store_true",
                    help="draft from the history alone, not from the group's samples decoding alongside")
    sp.add_argument("--engines", type=int, default=1,
                    help="engines the step's groups are spread over by a hash of the group, each with the KV budget "
                         "(slime: one engine per GPU with --rollout-num-gpus-per-engine 1; default 1)")
    sp.add_argument("--json", metavar="PATH", help="write the result as JSON")
    sp.add_argument("--plot", metavar="PNG", help="write the timeline of the first KV budget")
    sp.add_argument("--check", metavar="ENGINE_JSON",
                    help="check the simulator against a trace-mode bench engine result: each measured row's speedup "
                    "over plain decoding predicted on a profile built from that result and the same logged step")
    sp.set_defaults(func=_simulate)
