"""``histospec-sgl replay``: load a log, build a scenario, replay it with ours and the peers."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from histospec_sgl.replay import arctic
from histospec_sgl.replay.data import (
    PRESETS,
    FieldMap,
    ReplayDataError,
    Tokenization,
    default_tokenizer,
    load_rollouts,
    preset_path,
)
from histospec_sgl.replay.measure import run_method
from histospec_sgl.replay.methods import FINISH_MODES, Method, Ours
from histospec_sgl.replay.peers import CopyBound, PromptLookup, SGLangNgram, SGLangTrie, missing_peers
from histospec_sgl.replay.scenarios import Case, Selection, build_cases

PEERS = ("ngram", "sglang_trie_per_prompt", "sglang_trie_global")
#: Peers that need extra software (SGLang's own C++ corpus, ArcticInference: run from .venv-sglang).
OPTIONAL_PEERS = ("sglang_ngram_global", "arctic_per_prompt", "arctic_global")
#: Optional peers that run by default where their software is installed (SGLang's corpus is asked
#: for by name: it is JIT-compiled on first use).
ARCTIC_PEERS = ("arctic_per_prompt", "arctic_global")


def default_peers() -> tuple[str, ...]:
    """``PEERS``, plus ArcticInference's where it is installed (the rest are reported as missing)."""
    return PEERS + (ARCTIC_PEERS if arctic.missing_reason() is None else ())


DEFAULT_VERIFY_COSTS = (1.0, 1.1, 1.25, 1.5, 2.0)
#: Oracle ceilings (``--bounds``): what copying from the visible text could give at best.
BOUNDS = {"bound_copy_any": 0, "bound_copy_after_1": 1}


@dataclass
class ReplayOptions:
    preset: str | None = None
    input: Path | None = None
    fields: FieldMap | None = None
    data_root: Path | None = None
    tokenizer: Path | None = None
    scenario: str = "cross-sample"
    draft_tokens: int = 16
    chain: bool = False
    #: How a finished in-flight request becomes history for ours (``FINISH_MODES``).
    finish: str = "keep"
    seed: int = 0
    max_groups: int | None = None
    per_group: int | None = None
    history_size: int | None = None
    history_policies: int | None = None
    min_step: int | None = None
    peers: Sequence[str] = field(default_factory=default_peers)
    bounds: Sequence[str] = ()
    draft_config: dict[str, Any] = field(default_factory=dict)
    verify_costs: Sequence[float] = DEFAULT_VERIFY_COSTS
    batch_size: int = 64
    decode_step_ms: float = 20.0
    progress: bool = True


def _selection(o: ReplayOptions, defaults: dict[str, Any]) -> Selection:
    def pick(name: str, fallback: Any) -> Any:
        v = getattr(o, name)
        return v if v is not None else defaults.get(name, fallback)

    return Selection(
        max_groups=pick("max_groups", 0),
        per_group=pick("per_group", 2),
        history_size=pick("history_size", 0),
        history_policies=pick("history_policies", 0),
        min_step=pick("min_step", None),
        seed=o.seed,
    )


def make_methods(o: ReplayOptions) -> list[Method]:
    if o.finish not in FINISH_MODES:
        raise ReplayDataError(f"unknown finish mode {o.finish!r}; choose from {', '.join(FINISH_MODES)}")
    methods: list[Method] = [Ours(chain=o.chain, draft_config=o.draft_config, finish=o.finish)]
    for p in o.peers:
        if p == "ngram":
            methods.append(PromptLookup())
        elif p == "sglang_trie_per_prompt":
            methods.append(SGLangTrie(per_prompt=True))
        elif p == "sglang_trie_global":
            methods.append(SGLangTrie(per_prompt=False))
        elif p == "sglang_ngram_global":
            methods.append(SGLangNgram())
        elif p in ARCTIC_PEERS:
            why = arctic.missing_reason()
            if why is not None:
                raise ReplayDataError(f"peer {p} cannot run here: {why}")
            methods.append(arctic.per_prompt_method() if p == "arctic_per_prompt" else arctic.shared_cache_method())
        else:
            raise ReplayDataError(f"unknown peer {p!r}; choose from {', '.join(PEERS + OPTIONAL_PEERS)}")
    for b in o.bounds:
        if b not in BOUNDS:
            raise ReplayDataError(f"unknown bound {b!r}; choose from {', '.join(BOUNDS)}")
        methods.append(CopyBound(context=BOUNDS[b], max_len=o.draft_tokens - 1))
    return methods


def load_cases(o: ReplayOptions) -> tuple[list[Case], dict[str, Any]]:
    if (o.preset is None) == (o.input is None):
        raise ReplayDataError("give exactly one of --preset NAME or --input PATH")
    if o.preset is not None:
        if o.preset not in PRESETS:
            raise ReplayDataError(f"unknown preset {o.preset!r}; choose from {', '.join(PRESETS)}")
        pre = PRESETS[o.preset]
        path, fields, defaults, mirror = preset_path(pre, o.data_root), pre.fields, pre.defaults, pre.history_scenario
    else:
        if o.fields is None:
            raise ReplayDataError("--input needs at least --prompt-field and --response-field")
        assert o.input is not None
        path, fields, defaults, mirror = o.input, o.fields, {}, "cross-sample"
    rows = load_rollouts(path, fields)  # type: ignore[arg-type]
    sel = _selection(o, defaults)
    cases = build_cases(rows, o.scenario, sel, cold_mirrors=mirror)
    if not cases:
        raise ReplayDataError(f"scenario {o.scenario} selected no responses from {path}")
    tok = Tokenization(o.tokenizer or (None if fields.token_ids else default_tokenizer()))
    needed = [r for c in cases for r in (*c.history, *c.replay, *c.siblings)]
    tok.ensure(needed)
    info = {
        "input": str(path),
        "preset": o.preset,
        "scenario": o.scenario,
        "cold_mirrors": mirror if o.scenario == "cold" else None,
        "selection": sel.__dict__,
        "tokenizer": None if fields.token_ids else str(tok.path),
        "cases": len(cases),
        "replayed_responses": sum(len(c.replay) for c in cases),
        "history_responses": sum(len(c.history) for c in cases),
        "inflight_siblings": sum(len(c.siblings) for c in cases),
    }
    return cases, info


def run_replay(o: ReplayOptions, command: str | None = None) -> dict[str, Any]:
    cases, info = load_cases(o)
    methods = make_methods(o)
    bar = None
    if o.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases) * len(methods), desc="replay", unit="case", file=sys.stderr, leave=False)
    results: dict[str, Any] = {}
    try:
        for m in methods:
            if bar is not None:
                bar.set_postfix_str(m.name)
            tally = run_method(m, cases, o.draft_tokens, on_case=(bar.update if bar is not None else None))
            s = tally.summary(o.verify_costs, o.batch_size, o.decode_step_ms)
            s["description"] = m.description
            results[m.name] = s
    finally:
        if bar is not None:
            bar.close()
    ours = results.pop("ours")
    bounds = {k: results.pop(k) for k in list(results) if k in BOUNDS}
    for v in bounds.values():
        v["ours_share"] = ours["tokens_per_verify_step"] / v["tokens_per_verify_step"]
    peers: dict[str, Any] = {k: {"status": "ok", **v} for k, v in results.items()}
    for k, v in missing_peers().items():
        peers.setdefault(k, v)
    measured = {k: v for k, v in peers.items() if v.get("status") == "ok"}
    best = max(measured, key=lambda k: measured[k]["tokens_per_verify_step"]) if measured else None
    out: dict[str, Any] = {
        "command": command,
        "config": {
            **info,
            "draft_tokens": o.draft_tokens,
            "chain": o.chain,
            "finish": o.finish,
            "seed": o.seed,
            "draft_config": o.draft_config,
            "cost_model": {
                "verify_costs": list(o.verify_costs),
                "batch_size": o.batch_size,
                "decode_step_ms": o.decode_step_ms,
                "formula": "tokens_per_verify_step / (verify_cost + (draft_us + update_us) * batch_size / decode_step_us)",
            },
        },
        "ours": ours,
        "peers": peers,
        "bounds": bounds,
        "best_peer": best,
        "ours_vs_best_peer": (
            ours["tokens_per_verify_step"] / measured[best]["tokens_per_verify_step"] if best else None
        ),
    }
    return out
