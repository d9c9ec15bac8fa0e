"""Resolves SGLang's server arguments for command lines with the plugins loaded, in .venv-sglang,
and prints what HISTORY resolved to (for tests/engine/test_plugin.py):

    python sglang_resolve.py SGLANG_ARGS...          # one command line; fails as SGLang would
    python sglang_resolve.py --cases JSON            # [{"args": [...], "env": {...}}, ...] in one
                                                     # process: each case's HISTOSPEC_* environment
                                                     # alone, its result or its error
"""

import json
import os
import sys
import traceback

from sglang.srt.plugins import load_plugins

load_plugins()
from sglang.srt.server_args import prepare_server_args  # noqa: E402 (after the plugins are loaded)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402


def resolved(args: list) -> dict:
    algo = SpeculativeAlgorithm.from_string("history")
    sa = prepare_server_args(args)
    return dict(
        algo_type=type(algo).__name__, is_ngram=algo.is_ngram(), has_draft_kv=algo.has_draft_kv(),
        need_topk=algo.need_topk(), carries=algo.carries_draft_hidden_states(),
        supports_overlap=algo.supports_overlap,
        alg=sa.speculative_algorithm, d=sa.speculative_num_draft_tokens, topk=sa.speculative_eagle_topk,
        steps=sa.speculative_num_steps, mrr=sa.max_running_requests, mixed=sa.enable_mixed_chunk,
        attn=sa.attention_backend, breadth=sa.speculative_ngram_max_bfs_breadth,
        acc=sa.speculative_accept_threshold_acc)


if sys.argv[1:2] == ["--version"]:
    import sglang

    print("RESULT " + json.dumps(sglang.__version__))
elif sys.argv[1:2] == ["--cases"]:
    out = []
    for case in json.loads(sys.argv[2]):
        for k in [k for k in os.environ if k.startswith("HISTOSPEC_")]:
            del os.environ[k]
        os.environ.update(case.get("env") or {})
        try:
            out.append({"ok": True, "res": resolved(case["args"])})
        except BaseException as e:  # argparse exits; the plugin's checks raise
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    print("RESULT " + json.dumps(out))
else:
    print("RESULT " + json.dumps(resolved(sys.argv[1:])))
