"""The examples (examples/*/run_grpo.sh) as a user runs them: ``DRY_RUN=1`` prints the commands with
placeholders and starts nothing; without it a missing variable or flag stops the script before it
starts anything; the trainer command it would run parses with the trainer's own argument code
(slime's parser from its source, verl's Hydra config, OpenRLHF's argparse), the user's arguments
reach the trainer, and the user's Ray runtime env is merged, not replaced."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from sglang_subprocess import result, run_script

from conftest import ROOT

#: What a user passes, as each example's header shows it: nothing more (the examples add the rest).
EXAMPLES = {"slime": ["--hf-checkpoint", "/models/m", "--prompt-data", "/data/math.jsonl", "--rollout-batch-size",
                      "32", "--num-rollout", "100"],
            "verl": ["trainer.total_epochs=3"], "openrlhf": ["--rollout.temperature", "0.9"]}
NEEDS = {"slime": ["SLIME_DIR", "--hf-checkpoint", "--prompt-data", "--rollout-batch-size", "--num-rollout"],
         "verl": ["MODEL", "DATA"], "openrlhf": ["MODEL", "DATA"]}


def _run(trainer: str, tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The example with fake ``ray`` and ``histospec-sgl`` first on PATH: each records that it ran."""
    bin_dir, log = tmp_path / "bin", tmp_path / "started"
    bin_dir.mkdir(exist_ok=True)
    for name in ("ray", "histospec-sgl"):
        fake = bin_dir / name
        fake.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {log}\nexit 1\n")
        fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DATA", "SLIME_DIR", "DRY_RUN",
                                                             "RUNTIME_ENV_JSON")}
    r = subprocess.run(["bash", str(ROOT / "examples" / trainer / "run_grpo.sh"), *args], capture_output=True,
                       text=True, timeout=60,
                       env={**base, "PATH": f"{bin_dir}:{ROOT / '.venv' / 'bin'}:{base['PATH']}", **env})
    return r, log


def _submitted(stdout: str) -> tuple[dict, list[str]]:
    """The printed ``ray job submit`` command: its runtime env and the trainer's argv after ``--``."""
    line = next(x for x in stdout.splitlines() if x.startswith("+ ray job submit"))
    argv = shlex.split(line[2:])
    env = json.loads(next(a.split("=", 1)[1] for a in argv if a.startswith("--runtime-env-json=")))
    return env, argv[argv.index("--") + 1:]


@pytest.mark.parametrize("trainer", sorted(EXAMPLES))
def test_dry_run_prints_the_commands_and_starts_nothing(trainer, tmp_path):
    r, log = _run(trainer, tmp_path, DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    assert not log.exists(), log.read_text()
    assert "+ histospec-sgl ray draft-server" in r.stdout
    env, argv = _submitted(r.stdout)
    for name in NEEDS[trainer]:
        assert f"<{name.lstrip('-')}>" in " ".join(argv), (name, argv)  # the placeholder names it
    assert env["worker_process_setup_hook"] == "histospec_sgl.integrations.ray_setup.setup"
    assert env["env_vars"]["HISTOSPEC_DRAFT_SERVER_ACTOR"] == "histospec/histospec-draft-server"


@pytest.mark.parametrize("trainer", sorted(EXAMPLES))
def test_missing_settings_stop_the_script_before_it_starts_anything(trainer, tmp_path):
    r, log = _run(trainer, tmp_path)
    assert r.returncode == 2 and not log.exists()
    for name in NEEDS[trainer]:
        assert name in r.stderr, r.stderr


@pytest.mark.parametrize("trainer", [pytest.param(t, marks=pytest.mark.shared) if t == "slime" else t
                                     for t in sorted(EXAMPLES)])
def test_the_trainer_command_parses_with_the_trainers_own_code(trainer, tmp_path, sglang_py, request):
    user_env = {"env_vars": {"WANDB_API_KEY": "k", "HISTOSPEC_LENIENCE": "1.5"}, "pip": ["my-reward-lib"]}
    r, _ = _run(trainer, tmp_path, *EXAMPLES[trainer], DRY_RUN="1", MODEL="/models/m", DATA="/data/d",
                SLIME_DIR="/root/slime", RUNTIME_ENV_JSON=json.dumps(user_env))
    assert r.returncode == 0, r.stderr
    env, argv = _submitted(r.stdout)
    # The user's runtime env is kept, with the example's variables and hook added (the user's win).
    assert env["pip"] == ["my-reward-lib"] and env["env_vars"]["WANDB_API_KEY"] == "k"
    assert env["env_vars"]["HISTOSPEC_LENIENCE"] == "1.5"
    assert env["env_vars"]["HISTOSPEC_DRAFT_SERVER_ACTOR"] == "histospec/histospec-draft-server"
    penv = {}
    if trainer == "slime":
        src = request.getfixturevalue("slime_src")  # slime's parser, from its source
        assert argv[:2] == ["python3", "/root/slime/train.py"]
        argv, penv = argv[2:], {"PYTHONPATH": str(src)}
    elif trainer == "verl":
        assert argv[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
        argv = argv[3:]
    else:
        assert argv[:3] == ["python3", "-m", "openrlhf.cli.train_ppo_ray"]
        argv = argv[3:]
    got = result(run_script(sglang_py, "example_parse.py", trainer, json.dumps(argv), env=penv, timeout=300))
    if trainer == "slime":
        assert got["unknown"] == [] and got["algorithm"] == "HISTORY" and got["draft_tokens"] == 12
        assert got["generate"] == "histospec_sgl.integrations.slime.generate"
        assert got["record"] == "histospec_sgl.integrations.slime.record"
        assert got["config"] == str(ROOT / "examples" / "slime" / "histospec.yaml")
        assert got["hf_checkpoint"] == "/models/m" and got["n_samples"] == 8
        assert (got["rollout_batch_size"], got["num_rollout"], got["prompt_data"]) == (32, 100, "/data/math.jsonl")
    elif trainer == "verl":
        assert (got["name"], got["n"], got["algorithm"]) == ("sglang", 8, "HISTORY")
        assert got["router"] == str(ROOT / "examples" / "verl" / "router.yaml")
        assert got["model"] == "/models/m" and got["train_files"] == "/data/d/train.parquet"
        assert got["epochs"] == 3  # the user's override reached verl
        # verl's default v1 trainer, so its TransferQueue manager, announcing.
        assert got["use_v1"] and got["manager"] == "AnnouncingAgentLoopManagerTQ"
        assert got["manager_extends_the_trainers"]
    else:
        assert got["agent"].endswith("histospec_sgl/integrations/openrlhf_agent.py")
        assert (got["n"], got["model"], got["data"], got["correction"]) == (8, "/models/m", "/data/d", "token")
        assert got["temperature"] == 0.9  # the user's flag, after the example's, wins


def test_verl_spec_rl_switch_adds_the_agent_loop(tmp_path, sglang_py):
    r, _ = _run("verl", tmp_path, DRY_RUN="1", SPEC_RL="1", MODEL="/models/m", DATA="/data/d")
    _, argv = _submitted(r.stdout)
    got = result(run_script(sglang_py, "example_parse.py", "verl", json.dumps(argv[3:]), timeout=300))
    assert got["agent_loop"] == "histospec_specrl"
    assert got["agent_config"] == str(ROOT / "examples" / "verl" / "agent_loops.yaml")


def test_verl_legacy_trainer_gets_the_legacy_announcing_manager(tmp_path, sglang_py):
    r, _ = _run("verl", tmp_path, "trainer.use_v1=False", DRY_RUN="1", MODEL="/models/m", DATA="/data/d")
    _, argv = _submitted(r.stdout)
    got = result(run_script(sglang_py, "example_parse.py", "verl", json.dumps(argv[3:]), timeout=300))
    assert not got["use_v1"] and got["manager"] == "AnnouncingAgentLoopManager"
    assert got["manager_extends_the_trainers"]


@pytest.mark.parametrize("form", [["--rollout.n_samples_per_prompt", "16"], ["--rollout.n_samples_per_prompt=16"]])
def test_openrlhf_group_size_is_the_trainers_flag(form, tmp_path, sglang_py):
    """The user's --rollout.n_samples_per_prompt is the one group size: the trainer gets it once and the
    SPEC-RL executor's HISTOSPEC_N_SAMPLES follows it (a group of 16 gets 16 slots, not 8)."""
    r, _ = _run("openrlhf", tmp_path, *form, DRY_RUN="1", MODEL="/models/m", DATA="/data/d")
    assert r.returncode == 0, r.stderr
    env, argv = _submitted(r.stdout)
    assert env["env_vars"]["HISTOSPEC_N_SAMPLES"] == "16"
    assert sum(a.startswith("--rollout.n_samples_per_prompt") for a in argv) == 1, argv
    got = result(run_script(sglang_py, "example_parse.py", "openrlhf", json.dumps(argv[3:]), timeout=300))
    assert got["n"] == 16


@pytest.mark.parametrize("conflict", [{"N_SAMPLES": "8"},
                                      {"RUNTIME_ENV_JSON": json.dumps({"env_vars": {"HISTOSPEC_N_SAMPLES": "8"}})}])
def test_openrlhf_refuses_a_second_group_size(conflict, tmp_path):
    r, log = _run("openrlhf", tmp_path, "--rollout.n_samples_per_prompt", "16", MODEL="/models/m", DATA="/data/d",
                  **conflict)
    assert r.returncode == 2 and not log.exists(), r.stderr
    assert "n_samples_per_prompt" in r.stderr and "16" in r.stderr, r.stderr


def test_slime_checks_its_flags_and_paths_before_it_starts_anything(tmp_path):
    slime_dir = tmp_path / "slime"
    slime_dir.mkdir()
    (slime_dir / "train.py").write_text("")
    model = tmp_path / "model"
    model.mkdir()
    # Every flag slime requires, but a prompt file that is not there.
    r, log = _run("slime", tmp_path, "--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "nope.jsonl"),
                  "--rollout-batch-size", "32", "--num-epoch", "3", SLIME_DIR=str(slime_dir))
    assert r.returncode == 2 and not log.exists(), r.stderr
    assert f"--prompt-data {tmp_path / 'nope.jsonl'}: no such file" in r.stderr and "--hf-checkpoint" not in r.stderr
    # Without the batch size (slime's parser requires it) and a length: both named, nothing started.
    (tmp_path / "p.jsonl").write_text("{}\n")
    r, log = _run("slime", tmp_path, "--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "p.jsonl"),
                  SLIME_DIR=str(slime_dir))
    assert r.returncode == 2 and not log.exists(), r.stderr
    assert "--rollout-batch-size" in r.stderr and "--num-rollout or --num-epoch" in r.stderr, r.stderr
    # A SLIME_DIR without slime's train.py.
    r, log = _run("slime", tmp_path, *EXAMPLES["slime"], SLIME_DIR=str(tmp_path))
    assert r.returncode == 2 and "no train.py" in r.stderr and not log.exists(), r.stderr
