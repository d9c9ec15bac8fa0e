"""``bench index``'s SGLang peers on a 4-prompt W1, next to ours, in .venv-sglang (for
tests/peers/test_sglang_peers.py); prints one JSON line ``{"peer": ..., "ours": ...}``.

    python sglang_index_peer.py sam|trie
"""

import json
import sys

from histospec_sgl.bench import index_bench
from histospec_sgl.bench.index_peers import SGLangSAM, SGLangTriePeer
from histospec_sgl.bench.workload import W1, generate

w = generate(W1, prompts=4)
peer_cls = {"sam": lambda: SGLangSAM("PROB"), "trie": SGLangTriePeer}[sys.argv[1]]
peer = peer_cls().run(w, index_bench._rss, steps=3, acc_prompts=2, latency_requests=4)
ours = index_bench.acceptance(w, 2)
print(json.dumps({"peer": peer, "ours": ours}))
