"""What a draft server holds, for the trainer drivers' dead-server phases."""

from __future__ import annotations

import time


def records_by_version(address: str) -> dict[int, int]:
    """How many records of each policy version the draft server at ``address`` holds (its snapshot)."""
    from histospec_sgl import _core
    from histospec_sgl.sync.client import _Client

    counts: dict[int, int] = {}
    client = _Client(address)
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
