"""Trace mode of ``histospec-sgl bench engine`` (``--trace grpo``): a real RL log's responses decoded
through a real SGLang engine, with the target's choice at every position forced to the logged token.

The step is drawn from the GRPO log as ``histospec-sgl simulate`` draws one
(:func:`histospec_sgl.replay.scenarios.choose_groups`): ``groups`` prompts of one policy's run, 8
logged samples each, and as each prompt's history the same prompt's responses from
``history_policies`` other policies at that step (what an earlier epoch of a closely related policy
answered). Prompts (the logged prompt strings) and responses are tokenized with the model's own
tokenizer; every forced response ends with the model's end of sequence, so a request stops at its
logged length (or at ``max_new_tokens``).

What each method is given, as in training after a weight update (``flush_cache`` before every
row): HISTORY keeps its history (loaded at start, ``HISTOSPEC_HISTORY_LOAD``, under per-row group
keys so that no row drafts from another row's decoding of the same responses); NGRAM loses its
trie; ``ngram_corpus`` (SGLang 0.5.23's NGRAM) gets the row's history as an external corpus
(``/add_external_corpus``), the strongest thing a user can do without this project.

The forcing is a model class loaded from the checkout's ``bench/trace_model`` (never in the wheel;
see ``histospec_trace_models.llama_trace``). Every row of a trace run says ``"mode": "trace"``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# The logged step itself (drawn and tokenized as simulate --check draws it again) is the simulator's.
from histospec_sgl.simulate.trace import (  # noqa: F401 (this module's API too)
    SINGLE_REPEATS,
    TRACE_PRESETS,
    TraceGroup,
    TraceSpec,
    eos_of,
    requests,
    row_requests,
    workload,
)

TRACE_ARCH = "HistospecTraceLlamaForCausalLM"
TRACE_PACKAGE = "histospec_trace_models"


def trace_index(groups: list[TraceGroup], gi: int, si: int) -> int:
    """The request's entry in the trace file (:func:`write_trace_file`)."""
    return sum(len(g.samples) for g in groups[:gi]) + si


def write_trace_file(path: Path, groups: list[TraceGroup], eos: int) -> None:
    traces = [{"prompt_len": len(g.prompt_ids), "response": s} for g in groups for s in g.samples]
    Path(path).write_text(json.dumps({"eos": eos, "traces": traces}))


def write_history(path: Path, groups: list[TraceGroup], keys: list[str]) -> int:
    """HISTORY's start-up history (``HISTOSPEC_HISTORY_LOAD``): every group's history under each of
    ``keys`` (one per row: ``f"{key}:{group index}"``, the request's ``histospec_group``)."""
    from histospec_sgl.engine.drafter import GROUP_PARAM, group_of

    n = 0
    with open(path, "w") as f:
        for key in keys:
            for gi, g in enumerate(groups):
                gid = group_of({GROUP_PARAM: f"{key}:{gi}"})
                for h in g.history_ids:
                    f.write(json.dumps({"prompt_ids": g.prompt_ids, "response_ids": h, "group": gid}) + "\n")
                    n += 1
    return n


def trace_model_dir(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with its ``config.json`` naming the trace model class (the other files linked)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        target = out / f.name
        if f.name == "config.json" or target.exists():
            continue
        os.symlink(f.resolve(), target)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg["architectures"] = [TRACE_ARCH]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def trace_env(trace_file: Path, root: Path | None = None) -> dict[str, str]:
    """The server environment that loads the trace model class from the checkout."""
    from histospec_sgl.bench.engine_server import checkout_root

    root = root or checkout_root()
    if root is None or not (root / "bench" / "trace_model" / TRACE_PACKAGE).is_dir():
        raise RuntimeError("trace mode loads its model class from a histospec-sgl checkout's bench/trace_model: "
                           "run from the repository root")
    return {"SGLANG_EXTERNAL_MODEL_PACKAGE": TRACE_PACKAGE, "TRACE_MODE_FILE": str(trace_file),
            "PYTHONPATH": str(root / "bench" / "trace_model")}
