"""``sgl.Engine`` (what trainers embed) decoding through HISTORY on this machine's CPU, as
test_engine_cpu.py runs SGLang's HTTP server (its docstring says what is stood in): tokens equal
plain decoding's, with the collective RPCs, on SGLang 0.5.17 and 0.5.23 (and NGRAM's on 0.5.23, the
``ngram_corpus`` peer's engine; test_engine_cpu.py runs NGRAM on 0.5.17); and the
benchmark harness, ``histospec-sgl bench engine``, with the servers it starts (relaunched when their
port was taken, never outliving a killed harness).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _engine_checks import FIXED
from _engine_checks import random_prompts as _prompts

from conftest import DRIVERS, ROOT
from histospec_sgl.bench.engine_server import cpu_engine_env

D = 8
#: Each test starts up to four SGLang engines (15-30 s each on two cores).
pytestmark = pytest.mark.timeout(900)


def _engine_api(py: Path, model: Path, tmp_path: Path, extra_env: dict | None = None,
                methods: tuple[str, ...] = ("plain", "ngram", "history"), reload: bool = True) -> dict:
    spec = {"model": str(model), "prompts": _prompts(8, seed=2), "methods": list(methods), "reload": reload,
            "max_new_tokens": 48, "draft_tokens": D, "snapshot": str(tmp_path / "history.snap")}
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    base.update({**FIXED, **(extra_env or {})})  # _check_engine_api counts d tokens a step from a cold engine
    r = subprocess.run([str(py), str(DRIVERS / "cpu_engine_api.py"), json.dumps(spec)], capture_output=True,
                       text=True, timeout=900, env=cpu_engine_env(str(py), base=base), cwd=str(tmp_path))
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return json.loads(lines[-1][7:])


def _check_engine_api(res: dict) -> None:
    plain = res["plain"]["passes"][0]
    for method in ("plain", "ngram", "history"):
        for i, p in enumerate(res.get(method, {}).get("passes", [])):
            assert p["bs1"] == plain["bs1"] and p["bs_all"] == plain["bs_all"], (method, i)
    hist = res["history"]
    for p in hist["passes"][1:]:  # pass 2, and pass 3 after histospec_save, histospec_version, flush_cache
        assert p["tokens"] / p["steps"] >= D - 0.5, p
    if "loaded" not in hist:
        return
    # A fresh engine drafts little; after histospec_load of the snapshot it drafts whole responses.
    assert hist["loaded"]["bs_all"] == plain["bs_all"]
    assert hist["loaded"]["tokens"] / hist["loaded"]["steps"] >= D - 0.5
    assert hist["fresh"]["tokens"] / hist["fresh"]["steps"] < hist["loaded"]["tokens"] / hist["loaded"]["steps"]


@pytest.mark.memory(2.5)
def test_greedy_engine_api_history_equals_plain(sglang_py, greedy_model, tmp_path):
    """``sgl.Engine`` (what trainers embed): HISTORY's tokens equal plain decoding's, with the
    collective RPCs (histospec_save, histospec_version, histospec_load into a fresh engine)."""
    res = _engine_api(sglang_py, greedy_model, tmp_path, methods=("plain", "history"))
    assert res["sglang"] == "0.5.17"
    _check_engine_api(res)


@pytest.mark.memory(4.5)
def test_greedy_engine_api_on_sglang_0_5_23(sglang_py, sglang_0523, greedy_model, tmp_path):
    """``sgl.Engine`` on 0.5.23: HISTORY and NGRAM (the ``ngram_corpus`` benchmark peer's code) equal
    plain decoding, with the collective RPCs and flush_cache (the HTTP server on 0.5.23: test_lossless.py)."""
    res = _engine_api(sglang_py, greedy_model, tmp_path, {"PYTHONPATH": str(sglang_0523),
                                                          "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"},
                      reload=False)
    assert res["sglang"] == "0.5.23"
    _check_engine_api(res)


# -- the benchmark -------------------------------------------------------------------------------


FAKE_ENGINE = """#!{python}
import http.server, pathlib, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
launches = pathlib.Path({marker!r})
nccl = sys.argv[sys.argv.index("--nccl-port") + 1]
launches.write_text((launches.read_text() if launches.exists() else "") + f"{{port}} {{nccl}}\\n")
if len(launches.read_text().splitlines()) == 1:
    # What SGLang prints, and then keeps running, when its HTTP port was taken before it bound it.
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {{port}}): "
          "address already in use", flush=True)
    time.sleep(600)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_server_whose_port_was_taken_is_launched_again_on_another(tmp_path):
    """The engine stood in by a process that answers SGLang's health check: on its first launch it
    fails to bind its port as SGLang does (it prints the error and keeps running); the server is
    stopped and launched on a new port, which answers. Each launch names its torch.distributed port,
    drawn below the kernel's ephemeral range (where SGLang 0.5.17's own pick could be taken by an
    outgoing connection)."""
    from histospec_sgl.bench.engine_server import EngineServer
    from histospec_sgl.procs import ephemeral_low

    marker = tmp_path / "launches"
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_ENGINE.format(python=sys.executable, marker=str(marker)))
    fake.chmod(0o755)
    srv = EngineServer(tmp_path, "plain", python=str(fake), device="cuda", startup_timeout=60,
                       log_path=tmp_path / "server.log")
    first = srv.port
    try:
        srv.start()
        launches = [[int(p) for p in line.split()] for line in marker.read_text().splitlines()]
        assert [http for http, _ in launches] == [first, srv.port] and srv.port != first
        assert all(20000 <= nccl < ephemeral_low() for _, nccl in launches), launches
        with urllib.request.urlopen(srv.url + "/health_generate", timeout=5) as r:
            assert r.status == 200
    finally:
        srv.stop()
    assert srv.proc is None


def test_bench_engine_methods_and_their_ratios():
    """Each method's server, and the ratios of a row: a method named with ``_sync`` runs without the
    overlap scheduler, and ``vs_plain_sync`` compares with ``plain_sync`` where a row has one; a greedy
    row says whether its outputs are plain decoding's for the same requests."""
    from histospec_sgl.bench import engine_bench as eb
    from histospec_sgl.bench import engine_rows as rows_

    assert eb.server_spec("plain_sync") == ("plain", {}, ["--sleep-on-idle", "--disable-overlap-schedule"])
    assert eb.server_spec("plain") == ("plain", {}, ["--sleep-on-idle"])
    assert eb.server_spec("history_cost_sync") == ("history", {"HISTOSPEC_CONTROL": "cost"},
                                                   ["--sleep-on-idle", "--enable-metrics", "--disable-overlap-schedule"])
    assert eb.server_spec("history_cost")[:2] == ("history", {"HISTOSPEC_CONTROL": "cost"})
    assert eb.server_spec("history")[:2] == ("history", {"HISTOSPEC_CONTROL": "fixed"})
    with pytest.raises(ValueError, match="unknown method"):
        eb.server_spec("eagle")
    # A HISTORY method may name its own draft-token count; no other method can, nor a count below 1.
    from histospec_sgl.bench.engine_methods import parse

    assert eb.server_spec("history_d4_sync") == eb.server_spec("history_sync")
    assert (parse("history_cost_d4").base, parse("history_cost_d4").width(8), parse("history").width(8)) == (
        "history_cost", 4, 8)
    for bad in ("plain_d4", "ngram_d2", "history_d0", "ngram_corpus_sync", "history_d4x", "history_sync_d4"):
        with pytest.raises(ValueError, match="unknown method"):
            parse(bad)
    assert sorted(["history_d4", "history_cost", "history", "plain"], key=lambda m: parse(m).order()) == [
        "plain", "history", "history_d4", "history_cost"]
    point = {"pass": 1, "batch_size": 4, "temperature": 1.0, "siblings": 1}
    rows = [{"method": "plain", **point, "tokens_per_s": 100.0, "step_ms": 10.0, "tokens_per_s_runs": [90, 100, 120]},
            {"method": "plain_sync", **point, "tokens_per_s": 105.0, "step_ms": 9.5,
             "tokens_per_s_runs": [105, 105, 105]},
            {"method": "history_cost", **point, "tokens_per_s": 84.0, "step_ms": 12.0,
             "tokens_per_s_runs": [72, 84, 120]},
            {"method": "history", **point, "batch_size": 16, "tokens_per_s": 50.0, "step_ms": 20.0,
             "tokens_per_s_runs": [50]}]
    rows_.ratios(rows)
    assert (rows[2]["vs_plain"], rows[2]["vs_plain_sync"], rows[2]["verify_cost"]) == (0.84, 0.8, 1.2)
    # Each run against the plain run of its repeat: the host's drift between repeats cancels.
    assert rows[2]["vs_plain_runs"] == [0.8, 0.84, 1.0]
    # The default's verified-step tallies (draft tokens expected, accepted) per width and batch
    # bucket: a row's, the counters after it less before; the row's runs summed.
    assert rows_.tallies([{"4": {"8": [12.0, 7.0], "64": [3.0, 1.0]}, "8": {"8": [2.0, 2.0]}}],
                         {"4": {"8": [2.0, 1.0], "64": [3.0, 1.0]}, "8": {"8": [2.0, 2.0]}}) == {"4": {"8": [10.0, 6.0]}}
    runs = [{"tokens_per_s": t, "verified_tokens": {"4": {"8": [10.0, 6.0]}}} for t in (1.0, 2.0)]
    assert rows_.median_row(runs)["verified_tokens"] == {"4": {"8": [20.0, 12.0]}}
    # Each run's clock is kept, and simulate --check prices the row by its median run's (here the
    # second: walls 12, 10 and 9), not by the last run's, which stays the row's own.
    from histospec_sgl.simulate.profile import at_median_run

    runs = [{"tokens_per_s": 40 / w, "wall_s": w, "step_seconds": {"8": {"1": c}}, "prefill_s_fixed": f}
            for w, c, f in ((12.0, 0.3, 0.03), (10.0, 0.25, None), (9.0, 0.2, 0.02))]
    row = rows_.median_row(runs)
    assert row["median_run"] == 1 and row["step_seconds"] == {"8": {"1": 0.2}} and row["wall_s"] == 10.0
    assert row["step_seconds_runs"] == [{"8": {"1": c}} for c in (0.3, 0.25, 0.2)]
    priced = at_median_run(row)
    assert priced["step_seconds"] == {"8": {"1": 0.25}} and priced["prefill_s_fixed"] is None
    row["median_run"] = 0
    assert at_median_run(row)["step_seconds"] == {"8": {"1": 0.3}} and at_median_run(row)["prefill_s_fixed"] == 0.03
    assert at_median_run({"step_seconds": {"8": {"1": 0.3}}}) == {"step_seconds": {"8": {"1": 0.3}}}
    # A cost the median run's clock had not timed yet (a width first timed in a bucket in a later
    # run) is the nearest run's that had, the later of two as near; the median run's own stay.
    runs = [{"tokens_per_s": 40 / w, "wall_s": w, "step_seconds": st}
            for w, st in ((10.0, {"8": {"1": 0.3}, "2": {"1": 0.2}}), (12.0, {"8": {"1": 0.31, "8": 0.5}, "4": {"8": 0.45}}),
                          (9.0, {"8": {"1": 0.29, "8": 0.6}, "4": {"8": 0.4}, "2": {"8": 0.35}}))]
    row = rows_.median_row(runs)
    assert row["median_run"] == 0
    assert at_median_run(row)["step_seconds"] == {"2": {"1": 0.2, "8": 0.35}, "4": {"8": 0.45},
                                                  "8": {"1": 0.3, "8": 0.5}}
    row["median_run"] = 1
    runs[2]["step_seconds"]["2"]["1"] = 0.25
    assert at_median_run(rows_.median_row(runs) | {"median_run": 1})["step_seconds"] == {
        "2": {"1": 0.25, "8": 0.35}, "4": {"8": 0.45}, "8": {"1": 0.31, "8": 0.5}}
    assert rows[1]["vs_plain"] == 1.05 and rows[1]["vs_plain_sync"] == 1.0
    assert "vs_plain" not in rows[3] and "vs_plain_sync" not in rows[3]  # no plain row at batch 16
    greedy = {"pass": 1, "batch_size": 2, "temperature": 0.0, "siblings": 1}
    rows = [{"method": "plain", **greedy, "_outputs": [[1, 2], [3, 4]]},
            {"method": "history", **greedy, "_outputs": [[1, 2], [3, 4]]},
            {"method": "history_cost", **greedy, "_outputs": [[1, 2], [3, 5]]},
            {"method": "history", **point, "_outputs": [[1]]},
            {"method": "ngram", **greedy, "batch_size": 16, "_outputs": [[1]]}]
    rows_.identical(rows)
    assert [r["identical_to_plain"] for r in rows] == [True, True, False, None, None]
    assert all("_outputs" not in r for r in rows)


def test_a_plain_servers_trace_clock_times_its_steps_and_prefill_passes(tmp_path):
    """A plain server in trace mode is timed by the trace model (``TRACE_MODE_CLOCK``): its decode
    steps (``batch seconds``) per batch bucket on the step policy's clock, width 1 alone, and its
    prefill passes (``prefill tokens seconds``) as a fixed part and a part per prompt token, the
    first pass left out as a fresh server's warm-up, as the policy's clock does; the bench puts both
    on the plain row, so that ``simulate --check`` prices plain decoding by its own server."""
    from types import SimpleNamespace

    from histospec_sgl.bench.engine_server import prefill_cost, step_seconds, trace_clock, trace_passes

    log = tmp_path / "clock-plain.log"
    srv = SimpleNamespace(method="plain", env={"TRACE_MODE_CLOCK": str(log)})
    assert step_seconds(srv) == {} and prefill_cost(srv) is None  # nothing timed yet
    # 50 ms a pass and 2 ms a token; each shape's first timing is warm-up.
    log.write_text("".join(f"prefill {n} {s!r}\n" for n, s in ((100, 5.0), (100, 0.25), (300, 0.65), (1, 0.052)))
                   + "".join(f"{b} {s!r}\n" for b, s in ((1, 9.0), (1, 0.1), (1, 0.1), (4, 3.0), (4, 0.2), (3, 0.18))))
    cost = prefill_cost(srv)
    assert cost is not None and cost.fixed_s == pytest.approx(0.05) and cost.per_token_s == pytest.approx(0.002)
    assert step_seconds(srv)["1"]["1"] == pytest.approx(0.1) and set(step_seconds(srv)) == {"1"}
    assert set(step_seconds(srv)["1"]) == {"1", "4"}
    assert step_seconds(SimpleNamespace(method="ngram", env={})) == {}
    assert prefill_cost(SimpleNamespace(method="ngram", env={})) is None
    # A later run's passes alone (the bench's row of that run): every one kept, none as warm-up, so
    # its 12 steps at batch 1 (three slow, then nine fast) average what the run paid, where the
    # policy's clock keeps the last nine.
    before = trace_passes(srv)
    assert before == 10 and trace_passes(SimpleNamespace(method="ngram", env={})) is None
    with log.open("a") as f:
        f.write("".join(f"1 {s!r}\n" for s in [0.3] * 3 + [0.1] * 9) + "prefill 200 0.45\n")
    run = trace_clock(srv, since=before)
    assert run is not None and run.means[(1, 1)] == pytest.approx((3 * 0.3 + 9 * 0.1) / 12)
    assert set(run.means) == {(1, 1)}  # the run ran no batch-4 steps
    whole = trace_clock(srv)
    assert whole is not None and whole.means[(1, 1)] == pytest.approx(0.1)
    assert run.prefill() is not None and run.prefill().per_token_s == pytest.approx(0.45 / 200)


@pytest.mark.memory(4.5)
def test_bench_engine_writes_rows_for_every_point(sglang_py, greedy_model, tmp_path):
    """``histospec-sgl bench engine`` on the CPU engine, shrunk: its JSON has the documented keys and a
    row for every method, pass, batch size, temperature and sibling count; on the second greedy pass
    HISTORY emits more than one token per forward pass and plain decoding exactly one. With
    ``--server-starts 2`` each row runs once on each of two sets of servers, started one after the
    other, and the rows are over both."""
    out, logs = tmp_path / "engine.json", tmp_path / "logs"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "bench", "engine", "--model", str(greedy_model),
                        "--methods", "plain,history", "--batch-sizes", "1,4", "--temperatures", "0,1",
                        "--siblings", "4", "--max-new-tokens", "16", "--sampled-requests", "4", "--server-starts", "2",
                        "--json", str(out), "--log-dir", str(logs)],
                       capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert {"machine", "model", "rows", "settings", "command"} <= res.keys()
    assert res["settings"]["server_starts"] == 2 and res["settings"]["repeats"] == 1
    # Two servers a method, each with a log of its own.
    assert sorted(p.name for p in logs.iterdir()) == [f"server-{m}-s{k}.log" for m in ("history", "plain")
                                                       for k in (0, 1)]
    assert res["machine"]["sglang"] == "0.5.17" and res["model"]["kind"] == "random"
    points = {(x["method"], x["pass"], x["batch_size"], x["temperature"], x["siblings"]) for x in res["rows"]}
    want = {(m, p, b, t, n) for m in ("plain", "history") for p in (1, 2) for b in (1, 4) for t in (0.0, 1.0)
            for n in ((1, 4) if t and b == 4 else (1,))}
    assert points == want
    assert res["settings"]["sampled_requests"] == 4 and res["settings"]["fixed_length"] is False
    for x in res["rows"]:
        assert x["tokens_per_s"] > 0 and x["vs_plain"] > 0 and x["verify_cost"] > 0
        # One run on each set of servers, each paired with the plain run of its set.
        assert x["server_start_runs"] == [0, 1] and len(x["tokens_per_s_runs"]) == len(x["vs_plain_runs"]) == 2, x
        # Every server runs SGLang's overlap scheduler (on a CPU as on a GPU); greedy rows are plain
        # decoding's tokens, and HISTORY's contexts never disagreed with SGLang's.
        assert x["overlap"] is True, x
        # The prompt tokens, and those SGLang's radix cache covered: none shared on the first pass
        # (bar the chat template's), all but the one token each of the 4 requests computes on the
        # second, which repeats the first's prompts; the server's prefill chunk as it resolved it.
        assert x["prompt_tokens"] > 4 and 0 <= x["cached_tokens"] < x["prompt_tokens"], x
        if x["pass"] == 2:
            assert x["prompt_tokens"] - x["cached_tokens"] == 4, x
        assert x["prefill_chunk"] is None or x["prefill_chunk"] >= 1024, x
        assert x["identical_to_plain"] is (True if x["temperature"] == 0.0 else None), x
        assert x["context_mismatches"] == (0 if x["method"] == "history" else None), x
        # Every request runs to 16 tokens: greedy rows run one batch (at batch 1, four requests one
        # after the other), sampled rows batches until 4 requests.
        assert x["tokens"] == 16 * 4, x
        if x["method"] == "plain":
            assert x["tokens_per_step"] == 1.0
        elif x["pass"] == 2 and x["temperature"] == 0.0:
            assert x["tokens_per_step"] > 2.0, x
    assert "history" in r.stdout and "tokens_per_step" in r.stdout
    # The same result as a measured step-cost profile for simulate: plain steps at width 1, HISTORY's
    # verify steps at width d, per batch size.
    prof = tmp_path / "profile.json"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "bench", "profile", "--engine-json", str(out),
                        "--out", str(prof)], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.loads(prof.read_text())
    assert p["analytic"] is False and "measured" in p["description"]
    assert {(x["batch"], x["width"]) for x in p["points"]} == {(b, w) for b in (1, 4) for w in (1, 8)}
    assert all(x["step_s"] > 0 for x in p["points"])


ORPHAN_ENGINE = """#!{python}
import ctypes, http.server, signal, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
# Like SGLang's scheduler and detokenizer: a child that dies with the launcher (PR_SET_PDEATHSIG).
child = subprocess.Popen([sys.executable, "-c", "import ctypes, signal, time; "
                          "ctypes.CDLL(None).prctl(1, signal.SIGKILL); time.sleep(600)"])
print("CHILD", child.pid, flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

HARNESS = """
import sys, time
from histospec_sgl.bench.engine_server import EngineServer, running
with running(EngineServer(sys.argv[1], "plain", python=sys.argv[2], device="cuda", startup_timeout=60,
                          log_path=sys.argv[3])) as (srv,):
    print("SERVER", srv.proc.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_killed_harness_leaves_no_server_behind(tmp_path, sig):
    """A process that started engine servers and is killed (SIGTERM, or SIGKILL, which runs no
    cleanup) leaves none behind: each server's launcher dies with the thread that started it, and
    the launcher's own children (SGLang's scheduler and detokenizer, stood in here by a child that
    dies with its parent as they do) with it."""
    import os
    import signal

    fake = tmp_path / "fake_python"
    fake.write_text(ORPHAN_ENGINE.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "server.log"
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path), str(fake), str(log)],
                               stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    line = harness.stdout.readline()
    assert line.startswith("SERVER"), line
    server = int(line.split()[1])
    deadline = time.monotonic() + 30
    while "CHILD" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(log.read_text().split("CHILD")[1].split()[0])

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    assert alive(server) and alive(child)
    os.kill(harness.pid, getattr(signal, sig))
    harness.wait(30)
    harness.stdout.close()
    deadline = time.monotonic() + 30
    while (alive(server) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server) and not alive(child)
