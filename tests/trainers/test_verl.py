"""verl 0.9.1 (from PyPI, in .venv-sglang) through ``histospec_sgl.integrations.verl``:

- the ``verl.plugins`` entry point: after ``import verl``, SGLang's ``ServerArgs`` built from verl's
  own Hydra config with ``+actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_algorithm=
  HISTORY`` resolves to HISTORY; with verl's plugins turned off it is unknown (so the entry point is
  what registers it);
- SPEC-RL: two epochs of verl's real ``AgentLoopWorker.generate_sequences`` running the
  ``histospec_specrl`` agent loop from examples/verl/agent_loops.yaml, verl's ``LLMServerClient``,
  the prompt-affinity balancer made by verl's router factory from examples/verl/router.yaml, and two
  rollout-server actors that are verl's ``SGLangHttpServer`` with only its in-process engine stood
  in by the real CPU SGLang server (over HTTP), on a local Ray cluster;
- verl's own ``SGLangHttpServer.launch_server`` starts HISTORY on the CPU engine (its
  ``max_running_requests`` from ``max_num_seqs`` reaches SGLang), and drafting goes on through
  verl's ``sleep`` and ``wake_up`` (colocated) and its ``abort_all_requests``, which aborts plain
  requests and a SPEC-RL continuation in flight.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _engine_checks import FIXED
from _greedy import check_phases, run_in_group

from conftest import DRIVERS, ROOT, driver_path, require_modules

pytestmark = pytest.mark.timeout(600)
DRIVER = DRIVERS / "verl_driver.py"


@pytest.fixture(scope="module")
def verl_py(sglang_py) -> Path:
    return require_modules(sglang_py, "verl, ray, hydra", "verl is")


def _driver(py: Path, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HISTOSPEC_", "VERL_"))}
    base.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=driver_path(), **(env or {}))
    out = Path(args[-1])
    r = subprocess.run([str(py), str(DRIVER), *args], capture_output=True, text=True, timeout=540, env=base, cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-8000:]
    return json.loads(out.read_text())


def test_entry_point_makes_the_history_override_resolve(verl_py, text_model, tmp_path):
    on = _driver(verl_py, "compose", str(text_model), str(tmp_path / "on.json"))
    assert on["engine_kwargs"] == {"speculative_algorithm": "HISTORY", "speculative_num_draft_tokens": 8}
    assert on["entry_point_loaded"] is True
    assert on["server_args"] == {"ok": True, "algorithm": on["server_args"]["algorithm"], "draft_tokens": 8}
    assert "HISTORY" in on["server_args"]["algorithm"]
    off = _driver(verl_py, "compose", str(text_model), str(tmp_path / "off.json"),
                  env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert off["entry_point_loaded"] is False
    assert "Unknown speculative algorithm name: HISTORY" in off["server_args"]["error"]


@pytest.mark.memory(3)
def test_verl_launch_server_starts_history_and_keeps_it_through_sleep_wake_and_abort(verl_py, text_model, tmp_path):
    """verl_driver.py ``launch`` lists what it stands in (no CUDA here), and why."""
    from histospec_sgl.bench.engine_server import cpu_engine_env

    base = {k: v for k, v in os.environ.items() if not k.startswith(("HISTOSPEC_", "VERL_"))}
    base.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=driver_path(),
                **FIXED)
    out = tmp_path / "out.json"
    run_in_group([str(verl_py), str(DRIVER), "launch", str(text_model), str(out)],
                 cpu_engine_env(str(verl_py), base=base), tmp_path, 540)
    res = json.loads(out.read_text())
    assert res["server_args"]["speculative_algorithm"] == "HISTORY"
    assert res["server_args"]["speculative_num_draft_tokens"] == 8
    assert res["server_args"]["max_running_requests"] == 256  # verl's max_num_seqs, not SGLang's default
    phases = res["phases"]
    assert list(phases) == ["first", "second", "after_wake", "after_abort"]
    greedy = check_phases(phases)
    assert res["verl_generate"] == greedy[tuple(phases["first"][0]["prompt"])]
    # verl's abort_all_requests with requests in flight: each comes back as verl's aborted answer
    # (stop reason "abort", the tokens so far), nothing hangs, and after resume_generation the
    # engine drafts whole responses again (phase "after_abort" above).
    abort = res["abort"]
    for row in abort["plain"]:
        assert row["stop_reason"] == "abort" and len(row["token_ids"]) < 100  # none yet, if still queued
    # SPEC-RL's server manager: aborted in its continuation, it answers with the reused previous
    # response, what was generated after it, a log-prob for each, and the abort; an aborted answer is
    # not recorded as the slot's next previous response.
    sp = abort["specrl"]
    assert sp["stop_reason"] == "abort" and sp["reused"] == len(sp["previous"]) == 24
    assert sp["token_ids"][:24] == sp["previous"] and 24 <= len(sp["token_ids"]) < 100
    assert sp["log_probs"] == len(sp["token_ids"]) and len(sp["calls"]) == 2
    assert abort["kept"] == sp["previous"]


@pytest.mark.memory(9)
def test_specrl_agent_loop_two_epochs(verl_py, text_model, tmp_path):
    """verl's agent loop with SPEC-RL over two epochs, then verl's greedy validation twice, on an
    engine of its own running HISTORY's default step policy (as a user's would): after the sampled
    epochs, the repeated validation drafts the first one's responses whole."""
    from histospec_sgl.bench.engine_server import EngineServer

    with EngineServer(text_model, "history", python=str(verl_py), tokenizer=True, max_running=32,
                      log_path=tmp_path / "sglang.log") as srv:
        out = _driver(verl_py, "specrl", str(text_model), srv.url, str(tmp_path / "draft"),
                      str(tmp_path / "out.json"))
        # The driver's draft server was killed (SIGKILL) after step 1's records were acknowledged; step 2
        # ran without it (reusing from the mirror) and its records, queued meanwhile, reached the
        # restarted server, which kept step 1's from its data dir.
        assert out["durable"]["before_kill"] == {"1": 16}
        assert out["durable"]["settled"] is True and out["durable"]["after_restart"] == {"1": 16, "2": 16}

        # The draft server requires a token (as a job's does): every record above went through with it, and
        # a lookup with a wrong token fails with a message naming the setting, not silently empty.
        wrong = out["wrong_token"]
        assert "UNAUTHENTICATED" in wrong and "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE" in wrong, wrong
        first, second, validation, again = out["epochs"]
        assert len(first) == len(second) == 16
        # Validation (verl's greedy val_kwargs) runs the inner loop untouched: no slot, nothing reused.
        assert len(validation) == len(again) == 4
        for r in validation + again:
            assert r["slot"] == -1 and r["previous_len"] == 0 and r["reused"] == 0
            assert r["generated"] == len(r["response_ids"]) > 0
        # HISTORY's acceptance reaches verl's own metrics: every request carries the three fields, and
        # the repeated greedy validation drafts the first one's responses whole.
        assert all(r["spec"] is not None for rows in out["epochs"] for r in rows)
        assert [r["response_ids"] for r in again] == [r["response_ids"] for r in validation]
        m = out["spec_metrics"]
        assert set(m[3]) == {"rollout/spec_accept_rate", "rollout/spec_accept_length"}
        assert m[3]["rollout/spec_accept_length"] > 3.0 and m[3]["rollout/spec_accept_rate"] > 0.3, m
        for rows in (first, second):
            for prompt in range(4):
                mine = [r for r in rows if r["index"] == prompt]
                # verl ran the group's 4 samples; the slot counter gave them 4 distinct slots.
                assert sorted(r["slot"] for r in mine) == [0, 1, 2, 3]
            for r in rows:
                n = len(r["response_ids"])
                assert n > 0 and r["response_mask"] == [1] * n and len(r["rollout_log_probs"]) == n
                assert r["reused"] + r["generated"] == n
        assert all(r["previous_len"] == 0 and r["global_steps"] == 1 for r in first)
        # histospec's AnnouncingAgentLoopManager (verl's legacy manager, its worker a Ray actor) announced the
        # step's 4 groups before dispatching, keyed as the prompts its workers sent are; a follower
        # that had decoded those groups heard each of them.
        a = out["announce"]
        assert a["rows"] == 16 and len(a["announced_keys"]) == 4
        assert a["announced_keys"] == a["sent_keys"] and a["manager_announced"] == 4
        assert a["follower_announced"] == 4
        # The same through the v1 trainer's AnnouncingAgentLoopManagerTQ (verl's TransferQueue manager,
        # its worker verl's AgentLoopWorkerTQ): the step's outputs, read back from TransferQueue, came
        # from the announced groups, and the follower heard each group again.
        t = a["tq"]
        assert t["statuses"] == ["finished"] and t["rows"] == 16
        assert t["sent_keys"] == a["announced_keys"] and t["manager_announced"] == 4
        assert t["follower_announced"] == 4
        assert all(r["previous_len"] > 0 and r["global_steps"] == 2 for r in second)
        # The policy did not change between the epochs: every previous token is accepted.
        assert sum(r["reused"] for r in second) == sum(r["previous_len"] for r in second)
        prev = {(r["index"], r["slot"]): r["response_ids"] for r in first}
        for r in second:
            assert r["response_ids"][: r["reused"]] == prev[(r["index"], r["slot"])][: r["reused"]]
        # The second step's budget is 32: a previous response cut at 24 was continued through verl's
        # single-turn loop and server.
        continued = [r for r in second if r["reused"] == 24 and r["generated"] > 0]
        assert continued and all(len(r["response_ids"]) <= 32 for r in second)
        # The log-probs verl trains on are the current policy's: score each response afresh.
        for r in continued[:4] + second[:2] + first[:2]:
            scored = srv._post("/generate", {"input_ids": r["prompt_ids"] + r["response_ids"], "return_logprob": True,
                                             "logprob_start_len": len(r["prompt_ids"]) - 1,
                                             "sampling_params": {"temperature": 1.0, "max_new_tokens": 1}}, 120)
            lps = [e[0] for e in scored["meta_info"]["input_token_logprobs"]][-len(r["response_ids"]):]
            assert max(abs(a - b) for a, b in zip(lps, r["rollout_log_probs"])) < 1e-3
        # Prompt affinity: every call for a prompt (scoring, continuation, both epochs) hit one server.
        where: dict[tuple, set] = {}
        prompts = {tuple(r["prompt_ids"]) for r in first}
        for sid, calls in out["served"].items():
            for ids in calls:
                for p in prompts:
                    if tuple(ids[: len(p)]) == p:
                        where.setdefault(p, set()).add(sid)
        assert len(where) == 4 and all(len(s) == 1 for s in where.values()), where
        assert out["balancer"]["fallbacks"] == 0 and out["balancer"]["affinity_hits"] > 0
