"""The trainer drivers' draft server: token-protected, as a job's is, with what it holds for their
dead-server phases and the check that a wrong token is refused with a clear error."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

TOKEN_ENV = "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE"


def token_file(directory: str | os.PathLike[str]) -> str:
    """A new token in ``directory/token`` (this user only), for the server's --auth-token-file and
    every client's HISTOSPEC_DRAFT_SERVER_TOKEN_FILE."""
    path = Path(directory) / "token"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24))
    return str(path)


def records_by_version(address: str) -> dict[int, int]:
    """How many records of each policy version the draft server at ``address`` holds (its snapshot),
    read with this process's credentials."""
    from histospec_sgl import _core
    from histospec_sgl.sync.client import Credentials, _Client

    counts: dict[int, int] = {}
    client = _Client(address, **Credentials.from_env().kwargs())
    try:
        for msg in client._stream("Snapshot", b"", timeout=60):
            for r in _core.decode_records(msg, "snapshot")["records"]:
                v = int(r.get("version") or 0)
                counts[v] = counts.get(v, 0) + 1
    finally:
        client.close()
    return counts


def wait_records(address: str, version: int, n: int, timeout: float = 60.0) -> dict[int, int]:
    """Polls until the server holds ``n`` records of ``version`` (or the timeout); the counts."""
    deadline = time.monotonic() + timeout
    while True:
        counts = records_by_version(address)
        if counts.get(version, 0) >= n or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def wrong_token_error(address: str, directory: str | os.PathLike[str], timeout: float = 30.0) -> str:
    """What a SPEC-RL lookup says when its token file holds another token: the error's message, or
    ``"no error"`` when none came within ``timeout`` (a silent loss)."""
    from histospec_sgl.specrl.store import PreviousStore
    from histospec_sgl.sync.client import DraftServerError

    wrong = Path(directory) / "wrong-token"
    wrong.write_text("not-the-token")
    old = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = str(wrong)
    store = PreviousStore()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                store.get(address, 1, 0)
            except DraftServerError as e:
                return str(e)
            time.sleep(0.05)
        return "no error"
    finally:
        store.close()
        if old is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = old
