"""``histospec-sgl bench engine``: tokens/s and tokens per verify step of plain decoding, NGRAM and
HISTORY on a real SGLang server, on a first and a second pass over the same requests, at several batch
sizes, greedy and sampled, with independent requests and with n siblings per prompt.

Every method runs in its own server (:class:`~histospec_sgl.bench.engine_server.EngineServer`), all
started at once and idle-sleeping (``--sleep-on-idle``) while another one runs, so that the methods of
a row are timed one right after the other (in an order that rotates) and the ratios between them see
the same machine. Before each row's first pass every server's cache is flushed (NGRAM's corpus and the
radix cache go; HISTORY keeps its history, so each row's requests carry their own
``custom_params.histospec_group`` and start with none). With ``repeats`` > 1 each row runs that many
times, with fresh groups, and its numbers are the medians (``tokens_per_s_runs`` keeps every run).
A server's speed can sit a few percent off its neighbour's for its whole life, which a row's repeats on
one server cannot average out: ``server_starts`` > 1 (``--server-starts``) starts every method's server
that many times, one set after another, and runs all the rows ``repeats`` times on each, so that a row's
medians are over ``server_starts`` x ``repeats`` runs on as many servers (``server_start_runs`` says
which start each run was on; the step policy learns afresh on each, as a new engine does).
The second pass repeats the same requests: what an RL epoch sees when it re-samples its prompts. A
batch of B requests goes to the server in one ``/generate`` call and decodes together; at batch 1 the
row runs four requests one after the other (in trace mode, ``sampled_requests`` of them:
:func:`~histospec_sgl.simulate.trace.single_requests`).
A sampled row (temperature > 0) runs batches of B until it has run ``sampled_requests`` requests
(``--sampled-requests``), since sampled lengths, and with them a batch's tail, vary from run to run;
a greedy row repeats itself exactly and runs once. Where requests end at different times a batch
shrinks as it runs, so a row mixes batch sizes and its wall time follows its longest sample;
``fixed_length`` (``--fixed-length``) runs every request to ``max_new_tokens`` instead, past its end
of sequence, so that every method does the same work at the row's batch size throughout.

``tokens_per_step`` is completion tokens over forward passes (SGLang's ``spec_verify_ct``, 1 per token
for plain decoding); ``step_ms`` the row's wall time over the longest request's forward passes, so
``verify_cost`` (a speculative method's step time over plain decoding's in the same row) is the cost
of one verify step relative to one decode step at that batch size: the profile a rollout simulator
needs. ``history`` is HISTORY at a fixed width (``HISTOSPEC_CONTROL=fixed``: every decode step
verified at width d); ``history_cost`` is HISTORY with the cost model choosing each step's width
(``HISTOSPEC_CONTROL=cost``); :mod:`~histospec_sgl.bench.engine_methods` holds each method's
``HISTOSPEC_*`` settings, and a HISTORY method named with ``_d<N>`` (``history_d4``) drafts at most N
tokens where the run's others draft ``--draft-tokens``, so that two widths are timed in one run (every
row records its server's ``draft_tokens``, and a HISTORY row its ``control``: ``fixed`` or ``cost``).
Every server runs SGLang's overlap scheduler, as on a GPU (on a CPU SGLang itself turns it off for
speculative decoding; the CPU engine's stand-ins keep it on); a method named with ``_sync``
(``plain_sync``, ``history_sync``, ``history_cost_sync``, ``ngram_sync``) runs the synchronous loop
instead, and ``vs_plain_sync`` compares a row with ``plain_sync``. Each row says
which scheduler ran it (``overlap``), whether a greedy row's outputs equal plain decoding's for the
same requests (``identical_to_plain``; None where there is no plain row or the row samples), and how
many requests' relayed tokens did not add up with SGLang's ``seq_lens`` on a HISTORY server
(``context_mismatches``, its counter over the row; None for other methods). ``ngram_corpus`` is SGLang 0.5.23's NGRAM
(laid over the environment's SGLang, :func:`sglang_0523`) with an external corpus; in trace mode it
holds each row's history (:mod:`histospec_sgl.bench.engine_trace`), elsewhere nothing.

Two modes, named in every row (``mode``): ``sample``, the model's own sampling (``--model smollm2``
samples answers to the GRPO log's MATH questions under its chat template); and ``trace``
(``trace=...``), the logged responses of a real RL step forced through the engine, so that the
acceptance is the logging policy's (:mod:`histospec_sgl.bench.engine_trace`).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from histospec_sgl import settings
from histospec_sgl.bench.engine_methods import METHODS, parse, server_spec
from histospec_sgl.bench.engine_rows import OUTPUTS, identical, median_row, ratios, tallies
from histospec_sgl.bench.engine_server import (
    EngineServer,
    context_mismatches,
    host_seconds,
    plain_steps,
    prefill_cost,
    running,
    step_seconds,
    trace_clock,
    trace_passes,
    verified_tokens,
    verify_steps,
    width_steps,
)
from histospec_sgl.simulate.trace import SINGLE_REPEATS, row_requests, single_requests


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}
    for pkg in ("sglang", "torch", "histospec-sgl"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return info


def _model(spec: str, log: Callable[[str], None],
           data_root: Path | None = None) -> tuple[Path, list[list[int]], dict[str, Any]]:
    """The model directory, the prompts, and what to record about them."""
    from histospec_sgl.bench import engine_models

    if spec in engine_models.KINDS:
        path = engine_models.ensure(spec, log=log)
    else:
        path = Path(spec)
    info_file = path / "histospec_model.json"
    info: dict[str, Any] = json.loads(info_file.read_text()) if info_file.exists() else {"path": str(path)}
    info["path"] = str(path)
    if info.get("kind") == "rhyme":
        prompts = engine_models.rhyme_prompts()
    elif (path / "tokenizer.json").exists() and (path / "tokenizer_config.json").exists():
        prompts = math_prompts(path, data_root)
        info["prompts"] = f"{len(prompts)} MATH questions of the GRPO log under the model's chat template"
    else:
        import random

        rng = random.Random(0)
        vocab = int(info.get("params", {}).get("vocab", 512))
        prompts = [[rng.randrange(2, vocab - 1) for _ in range(rng.randrange(16, 64))] for _ in range(24)]
    return path, prompts, info


def math_prompts(model_dir: Path, data_root: Path | None, n: int = 24) -> list[list[int]]:
    """The first ``n`` distinct questions of the GRPO log, each as one user turn under the model's
    chat template (token ids)."""
    from transformers import AutoTokenizer

    from histospec_sgl.replay.data import PRESETS, iter_jsonl, preset_path

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    questions: list[str] = []
    for _, obj in iter_jsonl(preset_path(PRESETS["grpo"], data_root)):
        q = obj.get("question")
        if isinstance(q, str) and q not in questions:
            questions.append(q)
            if len(questions) == n:
                break
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for q in questions]


def corpus_budget(draft_tokens: int) -> int:
    """The draft nodes ``ngram_corpus`` gives its external corpus (SGLang's default is none, which
    leaves a loaded corpus unused): half of the d - 1 beside the root, rounded up; NGRAM's own trie of
    the requests in flight gets the rest."""
    return max(1, draft_tokens // 2)


def sglang_0523(python: str) -> Path:
    """SGLang 0.5.23 unpacked beside the environment's SGLang (``scripts/setup_sglang_env.sh``), or
    ``$HISTOSPEC_SGLANG_0523``."""
    env = settings.value("HISTOSPEC_SGLANG_0523")
    path = Path(env) if env else Path(os.path.abspath(python)).parents[1] / "sglang-0.5.23"
    if not (path / "sglang").is_dir():
        raise RuntimeError(f"ngram_corpus runs SGLang 0.5.23's NGRAM from {path}, which is missing "
                           "(scripts/setup_sglang_env.sh unpacks it; or set HISTOSPEC_SGLANG_0523)")
    return path


def _requests(prompts: list[list[int]], batch: int, siblings: int, row: str) -> tuple[list[list[int]], list[str]]:
    """``batch`` requests: distinct contexts (prompt r, cut by r // len(prompts) tokens so that repeats
    differ), or ``batch // siblings`` prompts with ``siblings`` samples each; and each one's group."""
    ids, groups = [], []
    for r in range(batch):
        if siblings > 1:
            p, cut = r // siblings, 0
        else:
            p, cut = r % len(prompts), r // len(prompts)
        prompt = prompts[p % len(prompts)]
        ids.append(prompt[: max(4, len(prompt) - cut)])
        groups.append(f"{row}:{p}:{cut}")
    return ids, groups


def _timed(srv: EngineServer, ids: list[list[int]], params: list[dict[str, Any]], batch: int,
           rids: list[str] | None = None, expect: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Runs the requests in batches of ``batch`` (batch 1: one after the other), one batch after the
    other. ``expect``: each traced request's forced tokens, checked against what the engine emitted
    (a trace run whose outputs differ from the log's would measure something else)."""
    widths_before, verified_before = width_steps(srv), verified_tokens(srv)
    mismatches_before = context_mismatches(srv)
    host_before, passes_before = host_seconds(srv), trace_passes(srv)
    t0 = time.perf_counter()
    tokens, steps, passes, outputs, prompt, cached = 0, [], 0, [], 0, 0
    for k in range(0, len(ids), batch):
        chunk = rids[k: k + batch] if rids is not None else None
        out = srv.generate(ids[k: k + batch], params[k: k + batch], rids=chunk)
        outputs += [list(o["output_ids"]) for o in out]
        tokens += sum(len(o["output_ids"]) for o in out)
        prompt += sum(int(o.get("meta_info", {}).get("prompt_tokens", 0)) for o in out)
        cached += sum(int(o.get("meta_info", {}).get("cached_tokens", 0)) for o in out)
        batch_steps = [verify_steps(o) for o in out]
        steps += batch_steps
        # Forward passes the row waited for: the longest request of each batch.
        passes += max(batch_steps)
        if expect is not None and chunk is not None:
            for rid, o in zip(chunk, out):
                if list(o["output_ids"]) != expect[rid]:
                    raise RuntimeError(f"TRACE MODE: the {srv.method} server's request {rid} emitted tokens that "
                                       f"differ from the logged ones (first 16: {list(o['output_ids'])[:16]} against "
                                       f"{expect[rid][:16]})")
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "tokens": tokens, "wall_s": round(wall, 4), "tokens_per_s": round(tokens / wall, 2),
        "tokens_per_step": round(tokens / max(1, sum(steps)), 3), "verify_steps": sum(steps),
        "step_ms": round(1000 * wall / max(1, passes), 3),
        # Prompt tokens, and those a cached prefix covered (the rest were prefilled), SGLang's count.
        "prompt_tokens": prompt, "cached_tokens": cached, OUTPUTS: outputs}
    mismatches = context_mismatches(srv)
    row["context_mismatches"] = (None if mismatches is None or mismatches_before is None
                                 else mismatches - mismatches_before)
    if widths_before is not None:
        after = width_steps(srv) or {}
        row["width_steps"] = {w: n - widths_before.get(w, 0) for w, n in sorted(after.items(), key=lambda x: int(x[0]))
                              if n - widths_before.get(w, 0) > 0}
        # The worker's host time a decode step (drafting and choosing the width), over the row.
        host = host_seconds(srv)
        n_steps = sum(row["width_steps"].values())
        row["host_ms_per_step"] = (round(1000 * (host - host_before) / n_steps, 3)
                                   if host is not None and host_before is not None and n_steps else None)
        # The default's verified steps per width and batch bucket: draft tokens expected, accepted.
        row["verified_tokens"] = tallies([verified_tokens(srv) or {}], verified_before)
        row["step_seconds"] = step_seconds(srv)  # a fixed-width server's: the widths it ran
        row["step_seconds_mean"] = step_seconds(srv, mean=True)
        # What the server's step policy timed a prefill pass to cost (a fixed width's too).
        row["prefill_s_fixed"], row["prefill_s_per_token"] = prefill_cost(srv) or (None, None)
    elif (clock := trace_clock(srv, since=passes_before)) is not None and clock.table:
        # A plain server in trace mode: this run's passes, timed by the trace model (its file read once).
        row["step_seconds"], row["step_seconds_mean"] = plain_steps(clock.table), plain_steps(clock.means)
        row["prefill_s_fixed"], row["prefill_s_per_token"] = clock.prefill() or (None, None)
    return row


def run(*, model: str = "rhyme", methods: tuple[str, ...] = METHODS, batch_sizes: tuple[int, ...] = (1, 4, 16, 64),
        temperatures: tuple[float, ...] = (0.0, 1.0), siblings: int = 8, max_new_tokens: int = 128,
        draft_tokens: int = 8, device: str = "cpu", python: str | None = None,
        repeats: int = 1, sampled_requests: int = 32, server_starts: int = 1,
        fixed_length: bool = False, log: Callable[[str], None] = print,
        log_dir: str | None = None, trace: str | None = None, trace_groups: int = 8, trace_seed: int = 0,
        data_root: Path | None = None) -> dict[str, Any]:
    parsed = {m: parse(m) for m in methods}
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if server_starts < 1:
        raise ValueError(f"server_starts must be at least 1, got {server_starts}")
    python = python or sys.executable
    path, prompts, model_info = _model(model, log, data_root)
    # The models and forced traces end answers themselves; ``fixed_length`` runs every request to
    # max_new_tokens all the same, so that a batch keeps its size to the end.
    ignore_eos = fixed_length or (model_info.get("kind") not in ("rhyme", "smollm2") and trace is None)
    settings: dict[str, Any] = {
        "mode": "trace" if trace else "sample", "batch_sizes": list(batch_sizes), "temperatures": list(temperatures),
        "siblings": siblings, "max_new_tokens": max_new_tokens, "draft_tokens": draft_tokens, "device": device,
        "ignore_eos": ignore_eos, "repeats": repeats, "server_starts": server_starts,
        "sampled_requests": sampled_requests, "fixed_length": fixed_length}
    if "ngram_corpus" in methods:
        settings["ngram_corpus_budget"] = corpus_budget(draft_tokens)
    work = tempfile.mkdtemp(prefix="histospec-bench-engine-")
    server_model, trace_groups_, trace_extra = path, None, {}
    if trace is not None:
        from histospec_sgl.bench import engine_trace as et
        from histospec_sgl.simulate.trace import digest

        spec = et.TraceSpec(trace, trace_groups, seed=trace_seed)
        trace_groups_ = et.workload(spec, path, data_root)
        eos = et.eos_of(path)
        et.write_trace_file(Path(work) / "trace.json", trace_groups_, eos)
        server_model = et.trace_model_dir(path, Path(work) / "model")
        trace_extra = et.trace_env(Path(work) / "trace.json")
        keys = [_row_key(t, b, r) for t in temperatures for b in batch_sizes for r in range(server_starts * repeats)]
        per_row = et.write_history(Path(work) / "history.jsonl", trace_groups_, keys) // max(1, len(keys))
        settings["trace"] = {**spec.to_json(), "requests": sum(len(g.samples) for g in trace_groups_),
                             "single_requests": single_requests(sampled_requests),
                             "history_responses_per_row": per_row,
                             "tokens": sum(len(s) for g in trace_groups_ for s in g.samples), "eos": eos,
                             "digest": digest(trace_groups_),
                             "note": "TRACE MODE (benchmark): every token forced to the logged response's"}
        log(f"[bench engine] TRACE MODE: {settings['trace']['requests']} logged responses of {trace_groups} "
            f"prompts forced through the engine; {per_row} history responses per row")
    longest_prompt = max(len(p) for p in ([g.prompt_ids for g in trace_groups_] if trace_groups_ else prompts))
    # The KV pool the largest batch needs (each request's prompt, its tokens and a draft), within the
    # 65,536 tokens a CPU server gets by default: a pretrained model's pool is sized to the need, so
    # that its servers fit the machine's memory side by side.
    kv_tokens = min(65536, max(8192, max(batch_sizes) * (longest_prompt + max_new_tokens + 2 * draft_tokens + 8)))
    large = int(model_info.get("parameters", 0)) >= 50_000_000

    def servers_of(start: int) -> dict[str, EngineServer]:
        """Every method's server, for the ``start``-th set (each set's logs and trace clocks apart)."""
        tag = f"-s{start}" if server_starts > 1 else ""
        servers: dict[str, EngineServer] = {}
        for method in methods:
            algo, env, extra = server_spec(method)
            paths = []
            if method == "ngram_corpus":
                paths.append(str(sglang_0523(python)))
                env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
                extra += ["--speculative-ngram-external-sam-budget", str(corpus_budget(draft_tokens))]
            if trace is not None:
                paths.append(trace_extra["PYTHONPATH"])
                env.update({k: v for k, v in trace_extra.items() if k != "PYTHONPATH"})
                if algo == "history":
                    env["HISTOSPEC_HISTORY_LOAD"] = str(Path(work) / "history.jsonl")
                elif algo == "plain":  # no step policy times its steps: the trace model does
                    env["TRACE_MODE_CLOCK"] = str(Path(work) / f"clock-{method}{tag}.log")
            if paths:
                env["PYTHONPATH"] = os.pathsep.join(paths)
            servers[method] = EngineServer(server_model, algo, python=python, device=device,
                                           draft_tokens=parsed[method].width(draft_tokens),
                                           dtype="float32" if device == "cpu" else "bfloat16",
                                           max_running=max(batch_sizes), env=env, extra_args=extra,
                                           max_total_tokens=kv_tokens,
                                           tokenizer=method == "ngram_corpus",
                                           log_path=Path(log_dir) / f"server-{method}{tag}.log" if log_dir else None)
        return servers

    runs: Runs = {}
    overlap: dict[str, bool] = {}
    chunk: dict[str, Any] = {}
    for start in range(server_starts):
        servers = servers_of(start)
        log(f"[bench engine] starting the servers: {', '.join(methods)}"
            + (f" (set {start + 1}/{server_starts})" if server_starts > 1 else ""))
        # Large servers loading at once starve each other's KV-pool sizing (five SmolLM2 did; two do not).
        with running(*servers.values(), one_at_a_time=large and len(servers) > 2):
            for m, srv in servers.items():
                overlap.setdefault(m, srv.overlap())
                chunk.setdefault(m, srv.prefill_chunk())
            for srv in servers.values():
                srv.generate([prompts[0] if trace is None else trace_groups_[0].prompt_ids],  # type: ignore[index]
                             {"temperature": 0.0, "max_new_tokens": 8})  # warm-up
            reps = range(start * repeats, (start + 1) * repeats)
            if trace is None:
                got = _sample_rows(servers, prompts, batch_sizes, temperatures, siblings, max_new_tokens, ignore_eos,
                                   reps, server_starts * repeats, sampled_requests, log)
            else:
                assert trace_groups_ is not None
                got = _trace_rows(servers, trace_groups_, batch_sizes, temperatures, max_new_tokens, ignore_eos,
                                  reps, server_starts * repeats, sampled_requests, log)
        for key, rs in got.items():
            runs.setdefault(key, []).extend({**r, "server_start": start} if server_starts > 1 else r for r in rs)
    shutil.rmtree(work, ignore_errors=True)
    rows = [{"method": m, "mode": settings["mode"], "pass": p, "batch_size": b, "temperature": t, "siblings": n,
             "draft_tokens": parsed[m].width(draft_tokens), "control": parsed[m].control, "overlap": overlap[m],
             "prefill_chunk": chunk[m], **median_row(rs)} for (m, p, b, t, n), rs in runs.items()]
    ratios(rows)
    identical(rows)
    return {"machine": machine_info(), "model": model_info, "device": device, "settings": settings, "rows": rows}


Runs = dict[tuple, list[dict[str, Any]]]


def _row_key(temp: float, batch: int, rep: int) -> str:
    return f"T{temp}-b{batch}-r{rep}"


def _sample_rows(servers: dict[str, EngineServer], prompts: list[list[int]], batch_sizes: tuple[int, ...],
                 temperatures: tuple[float, ...], siblings: int, max_new_tokens: int, ignore_eos: bool,
                 reps: range, total: int, sampled_requests: int, log: Callable[[str], None]) -> Runs:
    """The model's own samples: a first and a second pass over the same requests per row."""
    runs: Runs = {}
    order = list(servers)
    for temp in temperatures:
        for batch in batch_sizes:
            for sib in ([1, siblings] if temp > 0 and batch >= siblings > 1 else [1]):
                for rep in reps:
                    n = SINGLE_REPEATS if batch == 1 else batch
                    if temp > 0:
                        n = max(n, -(-sampled_requests // batch) * batch)
                    params_of = {}
                    for method, srv in servers.items():
                        ids, groups = _requests(prompts, n, sib, f"{method}-{temp}-{batch}-{sib}-{rep}")
                        params_of[method] = (ids, [{"temperature": temp, "max_new_tokens": max_new_tokens,
                                                    "ignore_eos": ignore_eos,
                                                    "custom_params": {"histospec_group": g}} for g in groups], None)
                        srv.flush_cache()
                    for pass_no in (1, 2):
                        _time_methods(servers, order, params_of, batch, (pass_no, batch, temp, sib), rep, total,
                                      runs, log)
                        order = order[1:] + order[:1]  # no method always runs first
    return runs


def _trace_rows(servers: dict[str, EngineServer], groups: list[Any], batch_sizes: tuple[int, ...],
                temperatures: tuple[float, ...], max_new_tokens: int, ignore_eos: bool, reps: range,
                total: int, sampled_requests: int, log: Callable[[str], None]) -> Runs:
    """The step's logged samples forced through each server, one pass per row, after a weight update
    (``flush_cache``); ``ngram_corpus`` gets the row's history as its external corpus."""
    from histospec_sgl.bench import engine_trace as et

    runs: Runs = {}
    order = list(servers)
    siblings = max(len(g.samples) for g in groups)
    for temp in temperatures:
        for batch in batch_sizes:
            for rep in reps:
                reqs = et.requests(groups, row_requests(batch, sampled_requests, single_requests(sampled_requests)))
                key = _row_key(temp, batch, rep)
                ids = [groups[gi].prompt_ids for gi, _ in reqs]
                params = [{"temperature": temp, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos,
                           "custom_params": {"histospec_group": f"{key}:{gi}"}} for gi, _ in reqs]
                rids = [f"{key}-{k}#trace{et.trace_index(groups, gi, si)}" for k, (gi, si) in enumerate(reqs)]
                used = sorted({gi for gi, _ in reqs})
                for method, srv in servers.items():
                    srv.flush_cache()
                    if method == "ngram_corpus":
                        srv.set_corpus([t for gi in used for t in groups[gi].history_text])
                params_of = {m: (ids, params, [f"{m}-{r}" for r in rids]) for m in servers}
                _time_methods(servers, order, params_of, batch, (1, batch, temp, siblings), rep, total, runs, log,
                              expect={f"{m}-{r}": groups[gi].samples[si][:max_new_tokens]
                                      for m in servers for r, (gi, si) in zip(rids, reqs)})
                order = order[1:] + order[:1]
    return runs


def _time_methods(servers: dict[str, EngineServer], order: list[str], params_of: dict[str, tuple], batch: int,
                  point: tuple, rep: int, total: int, runs: Runs, log: Callable[[str], None],
                  expect: dict[str, list[int]] | None = None) -> None:
    for method in order:
        ids, params, rids = params_of[method]
        r = _timed(servers[method], ids, params, batch, rids, expect)
        runs.setdefault((method, *point), []).append(r)
        pass_no, b, temp, sib = point
        log(f"[bench engine] {method} pass {pass_no} bs {b} T {temp} n {sib} run {rep + 1}/{total}: "
            f"{r['tokens_per_s']:.1f} tok/s, {r['tokens_per_step']:.2f} tok/step")


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"histospec-sgl bench engine: {result['model'].get('kind', result['model']['path'])} model, "
          f"{result['device']} ({m['cpu']}, {m['cores']} cores), sglang {m['sglang']}, "
          f"d={result['settings']['draft_tokens']}"
          + (" -- TRACE MODE (benchmark): logged tokens forced" if result["settings"].get("mode") == "trace" else ""))
    cols = ["method", "mode", "pass", "batch_size", "temperature", "siblings", "tokens_per_s", "tokens_per_step",
            "step_ms", "vs_plain", "vs_plain_sync", "verify_cost", "overlap", "identical_to_plain",
            "context_mismatches"]
    rows = sorted(result["rows"], key=lambda r: (r["temperature"], r["siblings"], r["batch_size"], r["pass"],
                                                 parse(r["method"]).order()))
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)))
