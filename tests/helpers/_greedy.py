"""Greedy rollouts against a trainer-launched engine, for the trainer engine tests (slime's and
verl's own engine code): the drivers run them by phase, the tests check the phases."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from histospec_sgl import procs

PROMPTS = [[(37 * i + 11 * j) % 500 + 2 for j in range(12)] for i in range(4)]  # ids within every test vocab
SAMPLES = 4


def greedy_rollout(url: str, max_new: int) -> list[dict]:
    """Every prompt's SAMPLES greedy samples at once (siblings), one ``/generate`` request each: the
    response and its tokens per verify step."""
    from histospec_sgl.bench.engine_server import verify_steps

    def one(ids: list[int]) -> dict:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                                      "ignore_eos": True}}
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        m = out["meta_info"]
        return {"prompt": ids, "output_ids": out["output_ids"], "per_step": m["completion_tokens"] / verify_steps(out),
                "weight_version": m.get("weight_version")}

    with ThreadPoolExecutor(SAMPLES * len(PROMPTS)) as pool:
        rows = list(pool.map(one, [p for p in PROMPTS for _ in range(SAMPLES)]))
    settle(url)
    return rows


def settle(url: str) -> None:
    """Returns once the engine's scheduler is idle.

    SGLang's scheduler sends a finished response before the loop step that ran it ends, and counts
    itself busy until it does; a weight update's cache flush and a memory release assert it is idle.
    A trainer reaches those calls only after gathering and post-processing the rollout; a driver
    that makes them the moment its last response arrives can beat the scheduler there on a loaded
    machine. ``/flush_cache`` succeeds only on an idle scheduler (and flushing the prefix cache after
    a rollout changes nothing the phases check: the history is kept)."""
    from histospec_sgl.bench.engine_server import flush_cache

    flush_cache(url)


def check_phases(phases: dict[str, list[dict]], min_per_step: float = 6.0) -> dict[tuple[int, ...], list[int]]:
    """Every phase gives the first phase's greedy responses (lossless), and every phase after the
    first drafts them from the history (more than ``min_per_step`` tokens per verify step on
    average). Returns the greedy response of each prompt."""
    greedy = {tuple(r["prompt"]): r["output_ids"] for r in phases["first"]}
    for name, rows in phases.items():
        assert len(rows) == SAMPLES * len(PROMPTS), name
        assert all(r["output_ids"] == greedy[tuple(r["prompt"])] for r in rows), name
        per_step = sum(r["per_step"] for r in rows) / len(rows)
        if name != "first":
            assert per_step > min_per_step, (name, per_step)
    return greedy


def run_in_group(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    """Runs a driver in its own process group, asserts it succeeded, returns its output; the group
    (the engine the trainer's code started) is killed afterwards, whatever happened."""
    done = procs.run_in_group(cmd, env=env, cwd=cwd, timeout=timeout)
    log = done.stdout
    assert done.returncode == 0, log[-6000:]
    return log
