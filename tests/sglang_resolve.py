"""Resolves SGLang's server arguments for a command line with the plugins loaded, in .venv-sglang,
and prints what HISTORY resolved to (for tests/test_plugin.py):

    python sglang_resolve.py SGLANG_ARGS...
"""

import json
import sys

from sglang.srt.plugins import load_plugins

load_plugins()
from sglang.srt.server_args import prepare_server_args  # noqa: E402 (after the plugins are loaded)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

algo = SpeculativeAlgorithm.from_string("history")
sa = prepare_server_args(sys.argv[1:])
print("RESULT " + json.dumps(dict(
    algo_type=type(algo).__name__, is_ngram=algo.is_ngram(), has_draft_kv=algo.has_draft_kv(),
    need_topk=algo.need_topk(), carries=algo.carries_draft_hidden_states(),
    supports_overlap=algo.supports_overlap,
    alg=sa.speculative_algorithm, d=sa.speculative_num_draft_tokens, topk=sa.speculative_eagle_topk,
    steps=sa.speculative_num_steps, mrr=sa.max_running_requests, mixed=sa.enable_mixed_chunk,
    attn=sa.attention_backend, breadth=sa.speculative_ngram_max_bfs_breadth,
    acc=sa.speculative_accept_threshold_acc)))
