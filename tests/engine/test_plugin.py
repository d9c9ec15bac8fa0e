"""The SGLang plugin against real SGLang 0.5.17 (and 0.5.23 laid over it), in fresh subprocesses of
``.venv-sglang`` (made by ``scripts/setup_sglang_env.sh``): entry-point discovery, argument
resolution through SGLang's own code, registration failures, the draft contract against SGLang's own
tree-link derivation, the TP broadcast over a real two-process ``torch.distributed`` group, the worker
glue with SGLang's NGRAM worker, and SGLang's NGRAM verify path on CPU.

``scripts/test.sh`` builds ``.venv-sglang`` and sets ``HISTOSPEC_REQUIRE_SGLANG=1``, so there these
tests fail instead of skipping when SGLang is missing.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _contract import check_contract
from _samples import humaneval
from sglang_subprocess import BASE, resolve, result, run_script, run_sglang, sglang_env

from conftest import DRIVERS, SGLANG_0523
from conftest import sglang_missing as _sglang_missing
from histospec_sgl import procs as children
from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.drafter import BatchDrafter
from histospec_sgl.procs import free_port

ROOT = Path(__file__).resolve().parents[2]


REGISTRATION = DRIVERS / "sglang_registration.py"

#: Command lines resolved by SGLang's own argument code, all in one process (each case with its
#: own HISTOSPEC_* environment): name -> (extra args, env).
CASES = {
    "history": (["--speculative-algorithm", "HISTORY", "--attention-backend", "flashinfer"], {}),
    "users-choices": (["--speculative-algorithm", "history", "--speculative-num-draft-tokens", "16",
                       "--max-running-requests", "8"], {}),
    "lenience": (["--speculative-algorithm", "HISTORY"], {"HISTOSPEC_LENIENCE": "1.6487"}),
    "lenience-and-threshold": (["--speculative-algorithm", "HISTORY", "--speculative-accept-threshold-acc", "0.5"],
                               {"HISTOSPEC_LENIENCE": "2"}),
    "triton": (["--speculative-algorithm", "HISTORY", "--attention-backend", "triton"], {}),
    "bad-setting": (["--speculative-algorithm", "HISTORY", "--attention-backend", "flashinfer"],
                    {"HISTOSPEC_THREADS": "-3"}),
    "ngram-untouched": (["--speculative-algorithm", "NGRAM", "--attention-backend", "triton"],
                        {"HISTOSPEC_THREADS": "-3"}),
}


@pytest.fixture(scope="module")
def resolved(sglang_py, tiny_model) -> dict[str, dict]:
    cases = [{"args": ["--model-path", str(tiny_model), *BASE, *args], "env": env} for args, env in CASES.values()]
    r = run_script(sglang_py, "sglang_resolve.py", "--cases", json.dumps(cases), timeout=240)
    return dict(zip(CASES, result(r)))


def _ok(case: dict) -> dict:
    assert case["ok"], case.get("error", "")[-3000:]
    return case["res"]


def _error(case: dict) -> str:
    assert not case["ok"], case
    return case["error"]


def test_entry_point_registers_history_and_resolves_ngram_defaults(resolved):
    res = _ok(resolved["history"])
    assert res["algo_type"] == "HistoryAlgo"
    assert res["is_ngram"] and not res["has_draft_kv"] and not res["need_topk"] and not res["carries"]
    assert res["supports_overlap"]
    # SGLang's NGRAM defaults, filled in by SGLang's own code.
    assert res["alg"] == "HISTORY" and res["d"] == 12 and res["mrr"] == 48 and res["mixed"] is False
    assert res["topk"] == res["breadth"] and res["steps"] == 12 // res["topk"]
    assert res["attn"] == "flashinfer"
    # The user's own choices win.
    res = _ok(resolved["users-choices"])
    assert (res["d"], res["mrr"]) == (16, 8)
    assert res["attn"] == "flashinfer", "an unset attention backend becomes FlashInfer"
    assert res["acc"] == 1.0, "exact verification by default"


def test_a_failed_check_stops_a_fresh_launch(sglang_py, tiny_model):
    """The same check as a command line of its own: the process fails and says why."""
    r = resolve(sglang_py, ["--model-path", str(tiny_model), *BASE, "--speculative-algorithm", "HISTORY",
                             "--attention-backend", "triton"])
    assert r.returncode != 0 and "--attention-backend flashinfer" in r.stderr, r.stderr[-3000:]


def test_lenience_sets_sglang_accept_threshold(resolved):
    assert _ok(resolved["lenience"])["acc"] == pytest.approx(1 / 1.6487)
    assert "set one of them" in _error(resolved["lenience-and-threshold"])


def test_wrong_backend_and_bad_settings_are_clear_errors(resolved):
    assert "--attention-backend flashinfer" in _error(resolved["triton"])
    assert "HISTOSPEC_THREADS" in _error(resolved["bad-setting"])
    # Other algorithms are untouched by the plugin (and by a bad HISTOSPEC_ value).
    res = _ok(resolved["ngram-untouched"])
    assert res["alg"] == "NGRAM" and res["attn"] == "triton"


def test_registration_is_idempotent_cheap_and_fails_loudly(sglang_py):
    r = run_script(sglang_py, REGISTRATION.name, "idempotent")
    assert "RESULT []" in r.stdout, r.stdout + r.stderr[-3000:]
    # A registration that fails inside SGLang's loader (which only logs plugin errors) stops a
    # process that asked for HISTORY, with the reason and the fix.
    r = run_script(sglang_py, REGISTRATION.name, "broken-install")
    assert r.returncode != 0 and "NOT REACHED" not in r.stdout
    assert "simulated broken install" in r.stderr and "launch-server --check" in r.stderr
    # An SGLang below the supported range (verl's [sglang] extra pins 0.5.12) stops the launch.
    r = run_script(sglang_py, REGISTRATION.name, "old-sglang")
    assert r.returncode != 0 and "NOT REACHED" not in r.stdout
    assert "supports sglang 0.5.15 to 0.5.23; found sglang 0.5.12" in r.stderr, r.stderr[-3000:]
    # The worker needs SGLang's NGRAM worker (a CUDA sgl_kernel): without it the factory says so.
    r = run_script(sglang_py, REGISTRATION.name, "no-worker")
    assert "RESULT histospec-sgl: the HISTORY worker cannot be imported" in r.stdout, r.stdout + r.stderr[-2000:]


def test_launch_server_check_finds_the_plugin(sglang_py):
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "launch-server", "--check"],
                       capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sglang 0.5.17" in r.stdout and "entry point histospec = histospec_sgl.plugin:register" in r.stdout
    assert "HISTORY -> CustomSpecAlgo('HISTORY')" in r.stdout


def _sglang_tree_links(py: Path) -> str:
    """SGLang's own host-side tree-link derivation (ngram_worker._derive_tree_links), lifted from the
    installed source: importing ngram_worker needs a CUDA sgl_kernel."""
    r = run_sglang(py, "import sglang, os; print(os.path.dirname(sglang.__file__))")
    src = Path(r.stdout.strip().splitlines()[-1], "srt", "speculative", "ngram_worker.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_derive_tree_links")
    return ast.get_source_segment(src, fn)


def test_draft_buffers_match_sglang_tree_reconstruction(sglang_py, tmp_path):
    """Our parents and BFS order, as SGLang's verification walks them: SGLang's derivation of
    first-child / next-sibling links from our masks must agree with our tree, and walking those
    links (as verify_tree_greedy does) must reach every real node exactly once."""
    d = 16
    dr = BatchDrafter(d, HistoryConfig(control="fixed"))
    tasks = humaneval(6)
    rids, roots = [], []
    for t, (prompt, samples) in enumerate(tasks):
        for s in samples[1:4]:
            dr.add_finished(prompt, s)
        rid = f"r{t}"
        head = samples[0][: max(1, min(20, len(samples[0]) // 2))]
        dr.sync(rid, prompt, head)
        rids.append(rid)
        roots.append(head[-1])
    tokens, mask = dr.draft(rids)[:2]
    parents = check_contract(tokens, mask, roots, d)
    np.save(tmp_path / "mask.npy", mask)
    code = _sglang_tree_links(sglang_py) + textwrap.dedent(f"""
        import numpy as np, json
        mask = np.load({str(tmp_path / 'mask.npy')!r}).astype(bool)
        nt, ns = _derive_tree_links(mask, {len(rids)}, {d})
        print("RESULT " + json.dumps([nt.tolist(), ns.tolist()]))
    """)
    r = run_sglang(sglang_py, "import numpy as np\nimport torch\n" + code)
    next_token, next_sibling = result(r)
    for b in range(len(rids)):
        seen = []

        def walk(node: int, b: int = b, seen: list[int] = seen) -> None:
            seen.append(node)
            c = next_token[b][node]
            while c != -1:
                assert parents[b][c] == node
                walk(c, b, seen)
                c = next_sibling[b][c]

        walk(0)
        assert sorted(seen) == list(range(d)), "every node reached once from the root"
    assert dr.totals.covered == len(rids), "every request got a draft from its group's history"


def test_tp_broadcast_gives_every_rank_rank0s_drafts(sglang_py, tmp_path):
    """Two real torch.distributed ranks (gloo, as SGLang's TP CPU group): rank 0 drafts from its
    index, rank 1 has none; both must return the same buffers, step after step, including a step
    where rank 0's drafting failed and it sent the empty draft."""
    script = DRIVERS / "tp_broadcast_rank.py"
    port = free_port()
    env = sglang_env()
    logs = [tmp_path / f"r{r}.log" for r in (0, 1)]
    ranks = []
    for r in (0, 1):
        with open(logs[r], "w") as log:
            ranks.append(children.spawn([str(sglang_py), str(script), str(r), str(port),
                                         str(tmp_path / f"r{r}.json")], env=env, stderr=log))
    try:  # each rank imports SGLang and torch: 15 s alone, minutes beside the other workers' servers
        for r, p in enumerate(ranks):
            assert p.wait(timeout=240) == 0, logs[r].read_text()[-3000:]
    finally:
        for p in ranks:
            children.stop(p)
    a = json.loads((tmp_path / "r0.json").read_text())
    b = json.loads((tmp_path / "r1.json").read_text())
    assert a == b and len(a) == 20
    assert any(any(t[1:8]) for t, _, _, _ in a), "rank 0 drafted real nodes"
    assert not a[7][3] and sum(drafted for _, _, _, drafted in a) >= 10  # step 7: the empty draft
    assert {w for _, _, w, _ in a} == {8}


def test_worker_glue_with_sglang_ngram_worker_on_cpu(sglang_py, tmp_path):
    """The real HistoryWorker (subclass of SGLang 0.5.17's real NGRAMWorker; only the CUDA kernel
    import is stubbed) driven through overlap-mode decode steps with fake requests: contexts follow
    the accepted tokens including the ones not yet in output_ids, siblings draft from each other,
    finished requests become history that survives flush_cache (up to where they finished), aborted
    ones do not."""
    snap = tmp_path / "snap.bin"
    auto = tmp_path / "auto" / "history.snap"
    prom = tmp_path / "prometheus"
    prom.mkdir()
    r = run_script(sglang_py, "sglang_worker_glue.py", str(snap),
                   env={"PYTHONPATH": str(ROOT / "bench" / "cpu_engine" / "stubs"), "HISTOSPEC_SNAPSHOT_PATH": str(auto),
                         "PROMETHEUS_MULTIPROC_DIR": str(prom)})
    res = result(r)
    assert res["responses"] == 3 and res["finished"] == 3 and res["after_flush"] == 4
    # a0 decodes 41 tokens one step at a time (nothing to draft from); its siblings, 15 steps late,
    # catch up with it within a few steps by drafting from its in-flight context (about 15 tokens
    # each), then all three advance together.
    assert res["steps"] <= 42 and res["accepted"] >= 26
    assert res["first"] >= 8, "a new epoch's first verify step takes a full draft from history"
    assert res["live"] == ["b0"] and res["key"] in res["groups"] and len(res["groups"]) == 2
    # A request that accepted tokens past where it finished (finished_len) is history up to there.
    assert res["cut"] == [[[6, 6, 6], list(range(300, 306))]]
    assert snap.exists() and snap.stat().st_size > 0
    # HISTOSPEC_SNAPSHOT_PATH is refreshed at flush_cache; it loads back with the same history.
    from histospec_sgl import HistoryIndex

    back = HistoryIndex()
    back.load(auto)
    assert back.stats()["responses"] == 4
    # --enable-metrics: the worker's counters reach SGLang's multiprocess Prometheus collection.
    m, tot, idx = res["metrics"], res["totals"], res["index"]
    assert m["histospec:decode_steps_total"] == tot["steps"] == res["steps"] + 3
    for name, key in [("request_steps", "request_steps"), ("covered_request_steps", "covered"),
                      ("draft_tokens_offered", "offered"), ("draft_tokens_accepted", "accepted"),
                      ("drafted_steps", "drafted_steps")]:
        assert m[f"histospec:{name}_total"] == tot[key], name
    assert m["histospec:draft_tokens_accepted_total"] >= res["accepted"] > 0
    assert m["histospec:finished_requests_total/1"] == 3 and m["histospec:finished_requests_total/0"] == 1
    assert 0 < m["histospec:draft_seconds_total"] <= m["histospec:host_seconds_total"]
    assert m["histospec:drafting"] == 1 and m["histospec:draft_errors_total"] == 0
    assert m["histospec:index_responses"] == idx["responses"] == 3
    assert m["histospec:index_bytes"] == idx["bytes"] > 0 and m["histospec:inflight_requests"] == 1


#: SGLang 0.5.23 unpacked by scripts/setup_sglang_env.sh, to lay over the 0.5.17 environment.


def _cpu_verify(py: Path, model: Path, *argv: str) -> tuple[list[str], dict]:
    """The command line and keywords that run tests/drivers/sglang_cpu_verify.py in the SGLang environment."""
    env = sglang_env(PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT / "bench" / "cpu_engine" / "stubs"),
                      SGLANG_USE_CPU_ENGINE="1")
    return [str(py), str(DRIVERS / "sglang_cpu_verify.py"), str(model), *argv], dict(
        cwd=str(DRIVERS), env=env)


def test_sglang_0_5_15_registers_resolves_and_drafts(sglang_py, tiny_model, tmp_path):
    """SGLang 0.5.15, the oldest release the plugin supports (slime's pin), laid over the 0.5.17
    environment (the same torch pin): HISTORY registers and resolves as a GPU server would (0.5.15's
    NGRAM defaults refuse any other device), and the real HistoryWorker, built through 0.5.15's own
    NGRAMWorker constructor, drafts through overlap-mode steps. 0.5.15's verify path has no CPU
    branches (its cache locations, tree verification and KV compaction are GPU kernels), so it runs
    on a GPU only (bench/gpu/)."""
    overlay = SGLANG_0523.parent / "sglang-0.5.15"
    if not (overlay / ".done").exists():
        _sglang_missing(f"{overlay} is missing: scripts/setup_sglang_env.sh did not finish",
                        "needs SGLang 0.5.15 unpacked by scripts/setup_sglang_env.sh")
    args = ["--model-path", str(tiny_model), "--device", "cuda", "--load-format", "dummy", "--skip-tokenizer-init",
            "--speculative-algorithm", "HISTORY"]
    r = resolve(sglang_py, args, env={"PYTHONPATH": str(overlay)})
    res = result(r)
    assert res["algo_type"] == "HistoryAlgo" and res["attn"] == "flashinfer" and res["d"] == 12, res
    version = run_script(sglang_py, "sglang_resolve.py", "--version", env={"PYTHONPATH": str(overlay)})
    assert "0.5.15" in version.stdout, version.stdout + version.stderr[-2000:]
    prom = tmp_path / "prometheus"
    prom.mkdir()
    r = run_script(sglang_py, "sglang_worker_glue.py", str(tmp_path / "snap.bin"),
                   env={"PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "cpu_engine" / "stubs"), str(overlay)]),
                        "PROMETHEUS_MULTIPROC_DIR": str(prom)})
    glue = result(r)
    assert glue["sglang"] == "0.5.15" and glue["responses"] == 3 and glue["accepted"] >= 26, glue


def test_sglang_verify_path_on_cpu_is_lossless_under_each_step_policy(sglang_py, tiny_model):
    """SGLang's own NGRAM verify path (forward_batch_generation: tree reconstruction, the
    TARGET_VERIFY batch, greedy tree verification, KV compaction) driven by the HISTORY worker on
    CPU, against a fake model that emulates tree attention from the KV slots and the mask it is
    given (tests/drivers/sglang_cpu_verify.py). Every response must equal plain greedy decoding on the
    synchronous loop (the overlap scheduler runs for real in test_lossless.py); history must be
    accepted at a fixed width; and the cost model must
    run both plain steps (the model's DECODE forward, one token per request) and verify steps at
    width d."""
    cmd, kw = _cpu_verify(sglang_py, tiny_model)
    _check_cpu_verify(result(subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)), "0.5.17")


def test_sglang_0_5_23_verify_path_on_cpu_is_lossless(sglang_py, tiny_model):
    """The same run on SGLang 0.5.23, laid over the 0.5.17 environment (its dependencies suffice for
    this path). 0.5.23 moved the worker's settings into a resolved runtime context and changed the
    NGRAM worker's constructor and verify call; every response must still equal greedy decoding."""
    if not (SGLANG_0523 / ".done").exists():
        _sglang_missing(f"{SGLANG_0523} is missing: scripts/setup_sglang_env.sh did not finish",
                        "needs SGLang 0.5.23 unpacked by scripts/setup_sglang_env.sh")
    cmd, kw = _cpu_verify(sglang_py, tiny_model)
    kw["env"]["PYTHONPATH"] += os.pathsep + str(SGLANG_0523)
    _check_cpu_verify(result(subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)), "0.5.23")


def _check_cpu_verify(res: dict, version: str) -> None:
    assert {run["sglang"] for run in res.values()} == {version}
    assert sorted(res) == ["cost", "fixed"]
    d = 8
    for name, run in res.items():
        first, second = run["epochs"]
        assert first["identical"] and second["identical"], name
        assert run["width_after"] == d and run["responses"] == 12, name
        assert run["context_mismatches"] == 0, name
        widths = {w for _, w in first["calls"] + second["calls"]}
        # Width 1 is a plain DECODE forward; a verify forward is always d wide.
        modes = set(first["modes"] + second["modes"])
        assert modes == ({"decode", "verify"} if 1 in widths else {"verify"}), name
        if name.endswith("cost"):
            # The cost model measures every width (plain decoding, 2, 4 and d, each verified at its
            # own width: the fake model sees w nodes a request) at each batch size before it
            # chooses, and every response stays what greedy decoding gives whichever it chooses.
            assert widths == {1, 2, 4, d} and run["plain_steps"] > 0, name
            assert run["measured_widths"] == [1, 2, 4, d], name
        else:
            # A fixed width times its own steps too (its clock, at d alone).
            assert widths == {d} and run["plain_steps"] == 0 and run["measured_widths"] == [d], name
            # Epoch 2 drafts each response whole from epoch 1's: about d tokens per verify step.
            assert second["steps"] * 4 < first["steps"], name


def test_sglang_verify_path_with_two_tp_ranks_runs_in_step(sglang_py, tiny_model, tmp_path):
    """The same verify path on two tensor-parallel ranks (real gloo over loopback): rank 0 drafts and
    broadcasts, rank 1 keeps no index. A plain step is chosen from the broadcast drafts, so
    both ranks take the same branch every step: neither waits on the other (a hang fails the
    timeout), and they run the same steps at the same widths with identical, lossless responses."""
    port = free_port()
    ranks = []
    for rank in (0, 1):
        cmd, kw = _cpu_verify(sglang_py, tiny_model, str(rank), str(port))
        with open(tmp_path / f"r{rank}.out", "w") as out:
            ranks.append(children.spawn(cmd, stdout=out, stderr=subprocess.STDOUT, **kw))
    try:
        for p in ranks:
            p.wait(timeout=600)
    finally:
        for p in ranks:
            children.stop(p)
    res = []
    for rank in (0, 1):
        text = (tmp_path / f"r{rank}.out").read_text()
        res.append(result(subprocess.CompletedProcess([], ranks[rank].returncode, text, "")))
    r0, r1 = res
    assert r0.keys() == r1.keys() and len(r0) == 2
    for name in r0:
        assert r0[name]["responses"] == 12 and r1[name]["responses"] is None, "rank 1 keeps no history"
        for k in ("epochs", "plain_steps", "width_after"):
            assert r0[name][k] == r1[name][k], (name, k)
        assert all(e["identical"] for e in r0[name]["epochs"]), name
    assert r0["cost"]["plain_steps"] > 0


def test_metrics_export_the_step_costs_the_default_policy_measured(sglang_py):
    """``histospec:step_seconds{width,batch}``: the costs the default policy times per verify width and
    batch bucket (and ``histospec:step_seconds_mean``, the means of the same timings), and
    ``histospec:prefill_seconds_fixed`` and ``_per_token``, read from a real drafter into a real prometheus_client
    registry; a fixed width's the same way (the engine's fixed policy times its steps too)."""
    r = run_sglang(sglang_py, """
        import json
        from prometheus_client import CollectorRegistry
        from histospec_sgl.engine.config import HistoryConfig
        from histospec_sgl.engine.drafter import BatchDrafter
        from histospec_sgl.plugin.metrics import HistoryMetrics
        out = {}
        for control in ("cost", "fixed"):
            reg = CollectorRegistry()
            dr = BatchDrafter(8, HistoryConfig(control=control))
            for w, s in ((1, 0.01), (8, 0.02), (4, 0.015)):
                for k in range(4):  # either policy times them
                    dr.policy.decode_step(6, w, 0.0)
                    dr.policy.begin(s * (3 if k == 3 else 1))  # the last one slow
            # Prefill passes of 100 prompt tokens (the first a warm-up) and of 10 (a cached prompt's few).
            for tokens, seconds in ((100, 0.5), (100, 0.3), (10, 0.12), (100, 0.3)):
                dr.policy.prefill_step(tokens, 0.0)
                dr.policy.begin(seconds)
            HistoryMetrics({"model_name": "m", "tp_rank": 0}, registry=reg).refresh_index(dr)
            for name in ("histospec:prefill_seconds_fixed", "histospec:prefill_seconds_per_token"):
                out[control + name[-6:]] = [round(s.value, 6) for m in reg.collect() for s in m.samples if s.name == name]
            for name in ("histospec:step_seconds", "histospec:step_seconds_mean"):
                out[control + ("-mean" if name.endswith("_mean") else "")] = sorted((s.labels["width"], s.labels["batch"], round(s.value, 6))
                                                  for m in reg.collect() for s in m.samples if s.name == name)
        print("RESULT " + json.dumps(out))
    """)
    got = result(r)
    assert (got["fixed"], got["fixed-mean"]) == (got["cost"], got["cost-mean"])
    # The line through the passes (100 tokens, 0.3 s) and (10, 0.12): 0.1 s a pass, 2 ms a token.
    assert got["cost_fixed"] == [0.1] and got["cost_token"] == [0.002], got
    assert (got["fixed_fixed"], got["fixed_token"]) == (got["cost_fixed"], got["cost_token"]), got
    # The first timing of each width in a bucket is left out (warm-up): three of four kept, bucket
    # 5-8, the last three times the others: the median leaves it out, the mean has it.
    assert got["cost"] == [["1", "8", 0.01], ["4", "8", 0.015], ["8", "8", 0.02]], got
    assert got["cost-mean"] == [["1", "8", 0.016667], ["4", "8", 0.025], ["8", "8", 0.033333]], got


def test_metrics_export_what_the_default_policys_verified_steps_expected_and_brought(sglang_py):
    """``histospec:verified_expected_tokens{width,batch}`` and ``histospec:verified_accepted_tokens``:
    per verify width and batch bucket, the draft tokens the default policy's verified steps were
    expected to bring (promises times its calibration) and brought, shadow drafts left out, each
    step counted once however often the worker reports; a fixed width exports none."""
    r = run_sglang(sglang_py, """
        import json
        from prometheus_client import CollectorRegistry
        from histospec_sgl.engine.config import HistoryConfig
        from histospec_sgl.engine.drafter import BatchDrafter
        from histospec_sgl.plugin.metrics import HistoryMetrics
        out = {}
        for control in ("cost", "fixed"):
            reg = CollectorRegistry()
            dr = BatchDrafter(8, HistoryConfig(control=control))
            m = HistoryMetrics({"model_name": "m", "tp_rank": 0}, registry=reg)
            expected = 0.0
            for step in range(3):
                for width, batch in ((4, 6), (8, 40)):
                    if control == "cost":
                        expected += dr.policy.calibration("sampled", width, batch) * 10.0 if width == 4 else 0.0
                    dr.policy.observe(10.0, 6.0, 2, klass="sampled", width=width, batch=batch)
                dr.policy.observe(50.0, 50.0, 1, shadow=True, klass="sampled", width=4, batch=6)
                m.observe(dr, host_seconds=0.0)
                m.observe(dr, host_seconds=0.0)  # reported again: nothing new
            out[control] = {"expected4": expected, "samples": sorted(
                (s.name, s.labels["width"], s.labels["batch"], round(s.value, 6)) for f in reg.collect()
                for s in f.samples if s.name.startswith("histospec:verified_") and s.name.endswith("_total"))}
        print("RESULT " + json.dumps(out))
    """)
    got = result(r)
    assert got["fixed"]["samples"] == [], got
    samples = {(name, w, b): v for name, w, b, v in got["cost"]["samples"]}
    # Three steps a width, bucket 5-8 and 33-64; the shadow drafts (50 promised, 50 accepted) left out.
    assert set(samples) == {(f"histospec:verified_{k}_tokens_total", w, b)
                            for k in ("expected", "accepted") for w, b in (("4", "8"), ("8", "64"))}, samples
    assert samples[("histospec:verified_accepted_tokens_total", "4", "8")] == 18.0
    assert samples[("histospec:verified_accepted_tokens_total", "8", "64")] == 18.0
    assert samples[("histospec:verified_expected_tokens_total", "4", "8")] == pytest.approx(
        got["cost"]["expected4"], abs=1e-5)
    assert 0 < samples[("histospec:verified_expected_tokens_total", "4", "8")] < 50
