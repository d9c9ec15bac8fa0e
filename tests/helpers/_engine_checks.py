"""What the engine tests (tests/test_engine_*.py and the trainers' engine tests) check on real SGLang
servers, written once: the server a test starts, greedy passes with their log-probs, sampled
continuations and the chi-square test that they are distributed as plain decoding's."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from histospec_sgl.bench.engine_server import EngineServer, verify_steps

#: A fixed verify width (d every step), for a check that counts d tokens per verify step from a cold
#: server: the engine's default policy decodes its first steps at each batch size plainly to time
#: them, so it promises no such count. A test that sets it says why where it does.
FIXED = {"HISTOSPEC_CONTROL": "fixed"}


def server(py: Path, model: Path, method: str, tmp_path: Path, *, draft_tokens: int = 8, **kw: Any) -> EngineServer:
    """A server for one test, its log in ``tmp_path/server-{tag}.log`` (``tag``: the method unless
    given); tests start theirs side by side (``running``) and idle ones sleep (``--sleep-on-idle``,
    which ``server_args`` adds on a CPU). HISTORY runs on the engine's default step policy, as users
    run it, unless ``env`` names another (:data:`FIXED`); ``extra``: more server arguments."""
    tag = kw.pop("tag", method)
    return EngineServer(model, method, python=str(py), draft_tokens=draft_tokens,
                        log_path=tmp_path / f"server-{tag}.log", extra_args=list(kw.pop("extra", ())), **kw)


def greedy_passes(srv: EngineServer, prompts: list[list[int]], *, n_tokens: int = 48, passes: int = 3,
                  singles: int = 2, flush_before: int | None = 2, group: str | None = None) -> list[dict]:
    """Greedy passes over ``prompts`` (each: the first ``singles`` prompts at batch 1, then all of them
    as one batch), ``flush_cache`` (a weight update) before pass ``flush_before`` (0-based; None:
    never), with each token's log-prob, as a trainer asks for them. ``group``: the requests'
    ``custom_params.histospec_group``. Per pass: outputs, log-probs, tokens and forward passes."""
    sp: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": n_tokens, "ignore_eos": True}
    if group is not None:
        sp["custom_params"] = {"histospec_group": group}
    out = []
    for i in range(passes):
        if i == flush_before:
            srv.flush_cache()
        outs = ([srv.generate([p], sp, return_logprob=True)[0] for p in prompts[:singles]]
                + srv.generate(prompts, sp, return_logprob=True))
        out.append({"outputs": [o["output_ids"] for o in outs],
                    "logprobs": [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs],
                    "tokens": sum(len(o["output_ids"]) for o in outs),
                    "steps": sum(verify_steps(o) for o in outs)})
    return out


def sample(srv: EngineServer, prompt: list[int], sp: dict[str, Any], *, rounds: int, width: int,
           group: str | None = None) -> tuple[list[tuple[int, ...]], float]:
    """``rounds`` batches of ``width`` samples of ``prompt``: the continuations, and tokens per
    forward pass over all of them (history grows from round to round, siblings draft in flight).
    ``group`` puts them in a history group of their own."""
    if group is not None:
        sp = {**sp, "custom_params": {"histospec_group": group}}
    seqs, tokens, steps = [], 0, 0
    for _ in range(rounds):
        for o in srv.generate([prompt] * width, sp):
            seqs.append(tuple(o["output_ids"]))
            tokens += len(o["output_ids"])
            steps += verify_steps(o)
    return seqs, tokens / steps


def same_distribution(a: list[tuple[int, ...]], b: list[tuple[int, ...]], ks: tuple[int, ...] = (2, 3, 4)) -> list[float]:
    """Chi-square test of homogeneity of the first k tokens of two sets of continuations, for each k in
    ``ks`` (outcomes seen fewer than 10 times pooled into one cell); the p-values. Each k must have an
    outcome seen 10 times, or the test would say nothing."""
    from scipy.stats import chi2_contingency

    ps = []
    for k in ks:
        ca, cb = Counter(x[:k] for x in a), Counter(x[:k] for x in b)
        keys = sorted(x for x in set(ca) | set(cb) if ca[x] + cb[x] >= 10)
        assert keys, f"no outcome of {k} tokens seen 10 times"
        rows = np.array([[c[x] for x in keys] + [n - sum(c[x] for x in keys)] for c, n in ((ca, len(a)), (cb, len(b)))])
        ps.append(float(chi2_contingency(rows[:, rows.sum(axis=0) > 0])[1]))
    return ps


def random_prompts(n: int, vocab: int = 500, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab - 1) for _ in range(rng.randrange(12, 40))] for _ in range(n)]


@contextlib.contextmanager
def broken_verify(switch: Path, kind: str) -> Iterator[None]:
    """Breaks one piece of the CPU verify (``CPU_ENGINE_BROKEN_FILE``, read at every step) of the
    servers started with ``switch``, until the block ends."""
    switch.write_text(kind)
    try:
        yield
    finally:
        switch.write_text("")
