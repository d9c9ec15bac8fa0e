"""A logged RL step as trace mode decodes it (``histospec-sgl bench engine --trace``) and as
``simulate --check`` re-runs it: the step drawn from the log as the simulator draws one
(:func:`histospec_sgl.replay.scenarios.choose_groups`), tokenized with the model's own tokenizer, and
which of its requests a row of a given batch size runs. The engine side (forcing the logged tokens)
is :mod:`histospec_sgl.bench.engine_trace`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The logs trace mode can decode (``--trace``): a preset of :mod:`histospec_sgl.replay.data` with
#: several policies per prompt and step.
TRACE_PRESETS = ("grpo",)


@dataclass
class TraceGroup:
    """One prompt of the step: its token ids, its history (token ids and text), its logged samples
    (token ids, each ending with the model's end of sequence)."""

    prompt_ids: list[int]
    history_ids: list[list[int]]
    history_text: list[str]
    samples: list[list[int]]


@dataclass(frozen=True)
class TraceSpec:
    preset: str = "grpo"
    groups: int = 8
    history_policies: int = 2
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def eos_of(model_dir: Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise ValueError(f"{model_dir}/config.json names no eos_token_id")
    return int(eos)


def workload(spec: TraceSpec, model_dir: Path, data_root: Path | None) -> list[TraceGroup]:
    """The step's groups, tokenized with ``model_dir``'s ``tokenizer.json``."""
    from histospec_sgl.replay.data import ReplayDataError, Tokenization, preset_rows
    from histospec_sgl.replay.scenarios import StepSpec, choose_groups

    if spec.preset not in TRACE_PRESETS:
        raise ReplayDataError(f"--trace {spec.preset!r}: trace mode decodes {', '.join(TRACE_PRESETS)}")
    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.exists():
        raise ReplayDataError(f"trace mode tokenizes the log with the model's tokenizer: {tok_file} is missing")
    rows = preset_rows(spec.preset, data_root, None, tokenize=False)  # only the step's rows are tokenized
    chosen = choose_groups(rows, StepSpec(spec.groups, spec.history_policies, spec.seed))
    tok = Tokenization(tok_file)
    eos = eos_of(model_dir)
    out = []
    for g in chosen:
        tok.ensure([*g.samples, *g.history])
        out.append(TraceGroup(list(g.samples[0].prompt_ids), [list(h.response_ids) + [eos] for h in g.history],
                              [str(h.response) for h in g.history], [list(m.response_ids) + [eos] for m in g.samples]))
    return out


def digest(groups: list[TraceGroup]) -> str:
    """A fingerprint of a step's tokens (prompts, history, samples, in order): ``bench engine --trace``
    records it, and ``simulate --check`` refuses a log that does not rebuild the same step."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for g in groups:
        h.update(json.dumps([g.prompt_ids, g.history_ids, g.samples], separators=(",", ":")).encode())
    return h.hexdigest()


def requests(groups: list[TraceGroup], n: int) -> list[tuple[int, int]]:
    """The first ``n`` requests of the step, group by group (a group's samples together, as a trainer
    submits them): ``(group index, sample index)``."""
    flat = [(gi, si) for gi, g in enumerate(groups) for si in range(len(g.samples))]
    if n > len(flat):
        raise ValueError(f"a row of {n} requests needs more than the step's {len(flat)}: raise --trace-groups")
    return flat[:n]


#: A batch-1 row of the model's own samples runs this many requests one after the other, as did a
#: trace row's before results recorded ``single_requests``.
SINGLE_REPEATS = 4


def single_requests(sampled_requests: int) -> int:
    """The requests a ``bench engine --trace`` batch-1 row runs one after the other:
    ``sampled_requests``, as at every batch size, and at least :data:`SINGLE_REPEATS` (a row of a
    few short logged answers is a few seconds, too short to time a ratio to a few percent on a noisy
    host)."""
    return max(SINGLE_REPEATS, sampled_requests)


def row_requests(batch: int, sampled_requests: int, single: int = SINGLE_REPEATS) -> int:
    """The requests of a trace row: at batch 1, ``single`` one after the other (a trace-mode result's
    ``single_requests``); else batches of ``batch`` until ``sampled_requests``."""
    return single if batch == 1 else max(batch, -(-sampled_requests // batch) * batch)
