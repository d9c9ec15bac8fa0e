"""Every registered ``HISTOSPEC_*`` variable outside the engine's own scope, with a valid value: what a
Ray runtime env hands every process of a job, an engine's included (tests/unit/test_settings.py and the CPU
engine test start HISTORY with them)."""

from __future__ import annotations

from pathlib import Path


def other_scopes(tmp_path: Path) -> dict[str, str]:
    """A new setting must be added here (tests/unit/test_settings.py checks that every one is)."""
    token, pem = tmp_path / "token", tmp_path / "ca.pem"
    token.write_text("secret\n")
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    return {
        "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE": str(token),
        "HISTOSPEC_DRAFT_SERVER_CA": str(pem),
        "HISTOSPEC_DRAFT_SERVER_MODE": "mirror",
        "HISTOSPEC_DRAFT_SERVER_ACTOR": "histospec/histospec-draft-server",
        "HISTOSPEC_SPECRL_TIMEOUT": "30",
        "HISTOSPEC_SLIME_INNER_GENERATE": "slime.rollout.sglang_rollout.generate",
        "HISTOSPEC_N_SAMPLES": "8",
        "HISTOSPEC_INNER_AGENT_FUNC_PATH": str(tmp_path / "agent.py"),
        "HISTOSPEC_REMOTE_RM_URL": "reward_func.py",
        "HISTOSPEC_LOG": "debug",
        "HISTOSPEC_DATA_DIR": str(tmp_path),
        "HISTOSPEC_TOKENIZER": str(tmp_path / "tokenizer.json"),
        "HISTOSPEC_MODEL_CACHE": str(tmp_path / "models"),
        "HISTOSPEC_SGLANG_0523": str(tmp_path / "sglang-0.5.23"),
        "HISTOSPEC_REQUIRE_SGLANG": "1",
        "HISTOSPEC_REQUIRE_SHARED": "1",
        "HISTOSPEC_TEST_MEMORY_GB": "13",
        "HISTOSPEC_TEST_MODEL": str(tmp_path / "model"),
        "HISTOSPEC_TEST_ACTOR": "1",
        "HISTOSPEC_TINY_MODEL": str(tmp_path / "tiny"),
        "HISTOSPEC_SHARED": str(tmp_path),
        "HISTOSPEC_SLIME_SRC": str(tmp_path / "slime"),
        "HISTOSPEC_FUZZ_EXAMPLES": "150",
        "HISTOSPEC_SGLANG_VERSION": "0.5.17",
    }


