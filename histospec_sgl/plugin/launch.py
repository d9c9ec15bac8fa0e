"""``histospec-sgl launch-server [--history-* options] [sglang launch_server args...]``.

Sets the ``HISTOSPEC_*`` variables from the ``--history-*`` options, checks them, adds
``--speculative-algorithm HISTORY`` and ``--attention-backend flashinfer`` unless given, and replaces
itself with ``python -m sglang.launch_server`` (same interpreter, same process id, so a supervisor's
signals reach SGLang directly). ``--check`` reports whether SGLang sees the plugin, and exits.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from histospec_sgl import settings
from histospec_sgl.engine.config import ENGINE_SCOPES, HistoryConfig, HistoryConfigError
from histospec_sgl.hugepages import prepare_children
from histospec_sgl.plugin import flag_value

#: --history-* option -> (environment variable, metavar), from the settings registry.
OPTIONS: dict[str, tuple[str, str]] = {s.flag: (s.env, s.metavar) for s in settings.SETTINGS if s.flag}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="histospec-sgl launch-server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start SGLang (python -m sglang.launch_server) with --speculative-algorithm HISTORY: "
        "drafts from the history of earlier responses to the same prompt. Arguments other than the "
        "ones below go to SGLang unchanged (see python -m sglang.launch_server --help).",
        epilog="Each --history-* option sets the environment variable of the same setting:\n\n"
        + settings.table(ENGINE_SCOPES, flagged=True)
        + "\n\nThe engine reads these without an option; set them in its environment:\n"
        + ", ".join(s.env for s in settings.SETTINGS if s.scope in ENGINE_SCOPES and not s.flag),
        add_help=True,
    )
    ap.add_argument("--check", action="store_true",
                    help="report the SGLang version and whether it discovers the HISTORY plugin, then exit")
    for opt, (env, metavar) in OPTIONS.items():
        ap.add_argument(opt, metavar=metavar, help=f"sets {env}")
    return ap


def check(python: str = sys.executable) -> int:
    """Asks a fresh interpreter what SGLang will see: its version and whether HISTORY registers."""
    code = (
        "import importlib.metadata as m, importlib.util, sys\n"
        "if importlib.util.find_spec('sglang') is None:\n"
        "    sys.exit(f'sglang is not installed for {sys.executable}: pip install sglang (0.5.15 to 0.5.23)')\n"
        "print('sglang', m.version('sglang'))\n"
        "eps = [e for e in m.entry_points(group='sglang.srt.plugins') if e.value.startswith('histospec_sgl')]\n"
        "print('entry point', eps[0].name + ' = ' + eps[0].value if eps else 'MISSING')\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"
        "print('HISTORY ->', SpeculativeAlgorithm.from_string('HISTORY'))\n"
        "import histospec_sgl._core as c\n"
        "print('native module', c.__version__)\n"
    )
    return subprocess.call([python, "-c", code])


def main(argv: Sequence[str]) -> int:
    ours, rest = _parser().parse_known_args(list(argv))
    env = dict(os.environ)
    for opt, (name, _) in OPTIONS.items():
        value = getattr(ours, opt[2:].replace("-", "_"))
        if value is not None:
            env[name] = value
    try:
        HistoryConfig.from_env(env)
    except HistoryConfigError as e:
        print(f"histospec-sgl launch-server: {e}", file=sys.stderr)
        return 2
    if ours.check:
        return check()
    algo = flag_value(rest, "--speculative-algorithm")
    if algo is None:
        rest += ["--speculative-algorithm", "HISTORY"]
    elif algo.upper() != "HISTORY":
        print(f"histospec-sgl launch-server: --speculative-algorithm {algo}: this launcher runs HISTORY; "
              "use python -m sglang.launch_server for other algorithms", file=sys.stderr)
        return 2
    backends = {f: flag_value(rest, f) for f in
                ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")}
    wrong = {f: v for f, v in backends.items() if v is not None and v != "flashinfer"}
    if wrong:
        got = ", ".join(f"{f} {v}" for f, v in wrong.items())
        print(f"histospec-sgl launch-server: HISTORY verifies draft trees with FlashInfer's custom attention "
              f"masks; got {got}. Use --attention-backend flashinfer.", file=sys.stderr)
        return 2
    if backends["--attention-backend"] is None:
        rest += ["--attention-backend", "flashinfer"]
    cmd = [sys.executable, "-m", "sglang.launch_server", *rest]
    print("histospec-sgl launch-server: " + " ".join(cmd), file=sys.stderr, flush=True)
    prepare_children(env)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached
