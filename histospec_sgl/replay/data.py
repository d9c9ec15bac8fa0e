"""Rollout logs: JSONL/JSONL.gz readers, built-in presets, field mappings and tokenization.

A log is read into :class:`Rollout` rows: one response to one prompt, with the group it belongs to
(one prompt's history), the policy that sampled it (a run, a checkpoint), the step/epoch/iteration
at which it was sampled, and its sample index. Text is tokenized lazily, only for the rows a
scenario replays or uses as history.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from histospec_sgl import settings
from histospec_sgl.errors import HistospecError


class ReplayDataError(HistospecError, ValueError):
    """A rollout log could not be read: malformed line, missing field, wrong type."""


@dataclass(frozen=True)
class FieldMap:
    """Where a log keeps each part of a rollout. ``response`` may hold a list (several samples)."""

    prompt: str
    response: str
    group: str | None = None  # default: the prompt itself
    step: str | None = None  # epoch, step or iteration
    sample: str | None = None  # default: order of appearance within (policy, step, group)
    policy: str | None = None  # run / checkpoint id; default: one policy
    token_ids: bool = False  # prompt and response hold token-id lists, not text


@dataclass(frozen=True)
class Preset:
    name: str
    relpath: str  # under the data root, or absolute / package-relative for shipped samples
    fields: FieldMap
    history_scenario: str  # the scenario "cold" mirrors
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)


_PKG_DATA = Path(__file__).resolve().parent.parent / "data"

PRESETS: dict[str, Preset] = {
    "grpo": Preset(
        "grpo",
        "cs336-grpo-math/grpo_rollouts.jsonl.gz",
        FieldMap("prompt", "response", group="prompt", step="step", sample="rollout_index", policy="run_id"),
        "cross-sample",
        "GRPO rollouts on MATH (Qwen2.5-Math-1.5B, 34 runs, 8 samples per group)",
        {"max_groups": 600, "per_group": 2, "history_policies": 1},
    ),
    "ei": Preset(
        "ei",
        "cs336-ei-math/ei_samples.jsonl.gz",
        FieldMap("prompt", "generated_text", group="prompt_id", step="ei_iter", policy="run"),
        "cross-policy",
        "expert-iteration samples on MATH (6 runs x 5 iterations, 56 samples per prompt)",
        {"max_groups": 384, "per_group": 2, "min_step": 2, "history_policies": 0},
    ),
    "humaneval": Preset(
        "humaneval",
        "codet-humaneval-codegen16b/HumanEval_codegen16B_temp0.8_topp0.95_num100_max300_code_solution.jsonl",
        FieldMap("prompt", "samples"),
        "cross-sample",
        "HumanEval completions (CodeGen-16B, T=0.8, 100 per prompt; MIT, microsoft/CodeT)",
        {"max_groups": 0, "per_group": 5, "history_size": 20},
    ),
    "humaneval-sample": Preset(
        "humaneval-sample",
        str(_PKG_DATA / "humaneval_sample.jsonl.gz"),
        FieldMap("prompt_ids", "samples_ids", group="task_id", token_ids=True),
        "cross-sample",
        "shipped sample: 24 HumanEval prompts x 100 CodeGen-16B completions, pre-tokenized (Qwen3)",
        {"max_groups": 0, "per_group": 5, "history_size": 20},
    ),
}


@dataclass
class Rollout:
    """One response. ``prompt``/``response`` are text, or token ids when the log holds ids."""

    group: str
    prompt: str | list[int]
    response: str | list[int]
    policy: str
    step: int | None
    sample: int
    source: str  # "path:line" for error messages
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None


def _candidates() -> list[Path]:
    env = settings.value("HISTOSPEC_DATA_DIR")
    if env:  # set: the only place looked at
        return [Path(env)]
    out = []
    repo = Path(__file__).resolve().parents[2]
    out += [repo.parent / "shared" / "data" / "rollouts", Path.cwd().parent / "shared" / "data" / "rollouts"]
    return out


def default_data_root() -> Path | None:
    """``$HISTOSPEC_DATA_DIR`` (when set, only it), else ``../shared/data/rollouts`` beside the
    repository or cwd."""
    for c in _candidates():
        if c.is_dir():
            return c
    return None


def default_tokenizer() -> Path | None:
    """``$HISTOSPEC_TOKENIZER``, else the Qwen3 tokenizer beside the data root."""
    env = settings.value("HISTOSPEC_TOKENIZER")
    if env:
        return Path(env)
    root = default_data_root()
    if root is not None:
        p = root.parent / "tokenizers" / "qwen3" / "tokenizer.json"
        if p.is_file():
            return p
    return None


def preset_path(preset: Preset, data_root: Path | None) -> Path:
    p = Path(preset.relpath)
    if p.is_absolute():
        return p
    root = data_root or default_data_root()
    if root is None:
        raise ReplayDataError(
            f"preset {preset.name!r} reads {preset.relpath} under the rollout data directory, which was not "
            "found: pass --data-root DIR or set HISTOSPEC_DATA_DIR"
        )
    return root / p


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL or JSONL.gz file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        f = opener(path, "rt", encoding="utf-8")
    except OSError as e:
        raise ReplayDataError(f"{path}: cannot open: {e}") from e
    with f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ReplayDataError(f"{path}:{n}: malformed JSON line: {e.msg} (column {e.colno})") from e
                if not isinstance(obj, dict):
                    raise ReplayDataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
                yield n, obj
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise ReplayDataError(f"{path}: unreadable ({e})") from e


_FLAG = {
    "prompt": "--prompt-field",
    "response": "--response-field",
    "group": "--group-field",
    "step": "--step-field",
    "sample": "--sample-field",
    "policy": "--policy-field",
}


def _get(obj: dict[str, Any], role: str, name: str, where: str) -> Any:
    if name not in obj:
        keys = ", ".join(sorted(obj)[:20])
        raise ReplayDataError(
            f"{where}: field {name!r} ({_FLAG[role]}) is missing; the line has: {keys}"
        )
    return obj[name]


def _ids(v: Any, role: str, where: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ReplayDataError(f"{where}: {role} must be a list of non-negative token ids in token-id format")
    return v


def _int(v: Any, role: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ReplayDataError(f"{where}: {role} must be an integer, got {type(v).__name__}")
    try:
        return int(v)
    except ValueError as e:
        raise ReplayDataError(f"{where}: {role} must be an integer, got {v!r}") from e


def load_rollouts(path: Path, fields: FieldMap) -> list[Rollout]:
    """Reads every rollout of a log. Errors name the file and line, and the field and its flag."""
    rows: list[Rollout] = []
    counters: dict[tuple[str, int | None, str], int] = {}
    for n, obj in iter_jsonl(path):
        where = f"{path}:{n}"
        prompt = _get(obj, "prompt", fields.prompt, where)
        resp = _get(obj, "response", fields.response, where)
        group = str(_get(obj, "group", fields.group, where)) if fields.group else None
        step = _int(_get(obj, "step", fields.step, where), "step", where) if fields.step else None
        policy = str(_get(obj, "policy", fields.policy, where)) if fields.policy else "policy"
        explicit = _int(_get(obj, "sample", fields.sample, where), "sample", where) if fields.sample else None
        if fields.token_ids:
            prompt = _ids(prompt, "prompt", where)
            many = isinstance(resp, list) and resp and isinstance(resp[0], list)
            responses = [_ids(r, "response", where) for r in resp] if many else [_ids(resp, "response", where)]
        else:
            if not isinstance(prompt, str):
                raise ReplayDataError(f"{where}: prompt field {fields.prompt!r} must be text (or use token-id format)")
            responses = resp if isinstance(resp, list) else [resp]
            if not all(isinstance(r, str) for r in responses):
                raise ReplayDataError(f"{where}: response field {fields.response!r} must be text or a list of texts")
        if group is None:
            group = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        for i, r in enumerate(responses):
            if len(responses) > 1:
                sample = i
            elif explicit is not None:
                sample = explicit
            else:
                key = (policy, step, group)
                sample = counters.get(key, 0)
                counters[key] = sample + 1
            row = Rollout(group, prompt, r, policy, step, sample, where)
            if fields.token_ids:
                row.prompt_ids = list(prompt)  # type: ignore[arg-type]
                row.response_ids = list(r)  # type: ignore[arg-type]
            rows.append(row)
    if not rows:
        raise ReplayDataError(f"{path}: no rollouts in the file")
    return rows


class Tokenization:
    """Tokenizes prompts and responses with a `tokenizers` BPE file, memoizing prompts."""

    def __init__(self, tokenizer_path: Path | None):
        self.path = tokenizer_path
        self._tok: Any = None
        self._prompts: dict[str, list[int]] = {}

    def _load(self) -> Any:
        if self._tok is None:
            if self.path is None:
                raise ReplayDataError(
                    "this log holds text: pass --tokenizer PATH (a tokenizers tokenizer.json) or set "
                    "HISTOSPEC_TOKENIZER, or use a token-id log"
                )
            from tokenizers import Tokenizer

            try:
                self._tok = Tokenizer.from_file(str(self.path))
            except Exception as e:  # tokenizers raises plain Exception subclasses
                raise ReplayDataError(f"{self.path}: not a usable tokenizer file: {e}") from e
        return self._tok

    def ensure(self, rows: Sequence[Rollout]) -> None:
        """Fills ``prompt_ids``/``response_ids`` for rows that lack them (batched)."""
        todo = [r for r in rows if r.response_ids is None]
        if not todo:
            return
        tok = self._load()
        prompts = sorted({r.prompt for r in todo if isinstance(r.prompt, str) and r.prompt not in self._prompts})
        if prompts:
            for p, enc in zip(prompts, tok.encode_batch(prompts, add_special_tokens=False)):
                self._prompts[p] = enc.ids
        encs = tok.encode_batch([r.response for r in todo], add_special_tokens=False)
        for r, enc in zip(todo, encs):
            r.prompt_ids = self._prompts[r.prompt]  # type: ignore[index]
            r.response_ids = enc.ids


def preset_rows(preset: str, data_root: Path | None, tokenizer: Path | None, tokenize: bool = True) -> list[Rollout]:
    """The rows of a preset's log (:data:`PRESETS`), tokenized with ``tokenizer`` (default: the
    preset's) when the log has no token ids and ``tokenize`` is set."""
    if preset not in PRESETS:
        raise ReplayDataError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    pre = PRESETS[preset]
    rows = load_rollouts(preset_path(pre, data_root), pre.fields)
    if tokenize and not pre.fields.token_ids:
        Tokenization(tokenizer or default_tokenizer()).ensure(rows)
    return rows
