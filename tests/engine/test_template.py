"""A template for an engine test: copy this file, rename the test, change the requests and the checks.

It has what every engine test has (docs/architecture.md, "Adding an engine test"):
- real SGLang servers on the CPU engine, started side by side with ``running`` and stopped on the way
  out: HISTORY on the engine's default step policy, as users run it (pass ``env=FIXED`` only for a
  check that counts d tokens a step, and say why), beside plain decoding as the reference;
- a model fixture from tests/conftest.py (here ``greedy_model``: random weights, so greedy decoding
  is deterministic and every method must agree token for token);
- the shared checks of tests/helpers/_engine_checks.py (here ``greedy_passes``);
- a ``memory`` mark, the test's measured peak, so that it waits for room beside the other worker;
- assertions that could fail: the tokens and log-probs equal plain decoding's, and HISTORY drafts
  from the history of the earlier passes (more than one token per forward pass).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from _engine_checks import greedy_passes, server

from histospec_sgl.bench.engine_server import running, width_steps

pytestmark = pytest.mark.timeout(600)


@pytest.mark.memory(4.5)
def test_history_on_the_default_policy_repeats_plain_decoding(sglang_py, greedy_model, tmp_path):
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 499) for _ in range(rng.randrange(12, 40))] for _ in range(8)]
    with running(server(sglang_py, greedy_model, "plain", tmp_path, max_running=8),
                 server(sglang_py, greedy_model, "history", tmp_path, max_running=8,
                        extra=["--enable-metrics"])) as (plain, history):
        want = greedy_passes(plain, prompts, passes=1, flush_before=None)[0]
        got = greedy_passes(history, prompts, passes=3, flush_before=None)
        widths = width_steps(history) or {}
    for i, p in enumerate(got):
        assert p["outputs"] == want["outputs"], f"pass {i + 1} differs from plain decoding"
        lp = np.abs(np.concatenate(p["logprobs"]) - np.concatenate(want["logprobs"]))
        assert lp.max() < 1e-4, (i, lp.max())  # the current policy's log-probs (float32 model)
    # The later passes repeat the first: the default policy verifies drafts from its history.
    assert got[2]["tokens"] / got[2]["steps"] > 2.0, got[2]
    assert any(n > 0 for w, n in widths.items() if w != "1"), widths
