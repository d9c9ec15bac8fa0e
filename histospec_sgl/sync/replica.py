"""A standalone index replica: subscribe to a draft server, apply into a fresh :class:`HistoryIndex`,
and report once a given sequence is applied. Used by the tests and ``histospec-sgl bench sync``::

    python -m histospec_sgl.sync.replica --address 127.0.0.1:50061 --until-sequence 4096

Prints ``ready`` once subscribed, then one JSON line: ``applied_sequence``, ``applied_at`` (the
``time.time()`` when the last record was applied), the index's ``stats`` and ``checksum`` (BLAKE2b-64
of its snapshot bytes, equal across replicas that hold the same history).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time

from histospec_sgl import HistoryIndex, procs
from histospec_sgl.sync.subscribe import HistorySubscriber


def spawn(address: str, until: int, *, checksum: bool = True, receive_only: bool = False,
          timeout: float = 600.0) -> subprocess.Popen:
    """Starts a replica process (it dies with the thread that started it) and returns once it is
    subscribed; its JSON line is then on its stdout."""
    p = procs.spawn([sys.executable, "-m", "histospec_sgl.sync.replica", "--address", address,
                     "--until-sequence", str(until), "--timeout", str(timeout),
                     *([] if checksum else ["--no-checksum"]), *(["--receive-only"] if receive_only else [])],
                    stdout=subprocess.PIPE, text=True, group=False)
    assert p.stdout is not None
    if procs.read_line(p, "ready", timeout) is None:
        procs.stop(p)
        p.stdout.close()
        raise RuntimeError(f"replica did not start within {timeout:.0f} s (it prints 'ready' once subscribed)")
    return p


def checksum(index: HistoryIndex) -> str:
    """BLAKE2b-64 (hex) of the index's snapshot bytes: equal for replicas holding the same history."""
    return hashlib.blake2b(index.to_bytes(), digest_size=8).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m histospec_sgl.sync.replica", description=__doc__)
    ap.add_argument("--address", required=True)
    ap.add_argument("--until-sequence", type=int, required=True)
    ap.add_argument("--auth-token", default=None)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--no-checksum", action="store_true", help="skip the snapshot checksum (large indexes)")
    ap.add_argument("--receive-only", action="store_true", help="decode records without building an index")
    args = ap.parse_args(argv)
    index = None if args.receive_only else HistoryIndex()
    sub = HistorySubscriber(args.address, index, auth_token=args.auth_token, background=True)
    sub.start()
    print("ready", flush=True)
    try:
        sub.wait_applied(args.until_sequence, args.timeout)
        applied_at = time.time()
    except Exception as e:  # report, never hang
        print(json.dumps({"error": str(e), "applied_sequence": sub.applied_sequence}), flush=True)
        return 1
    finally:
        sub.close()
    out = {
        "applied_sequence": sub.applied_sequence,
        "applied_at": applied_at,
        "applied_records": sub.applied_records,
        "snapshots": sub.snapshots,
        "reconnects": sub.reconnects,
        "stats": index.stats() if index is not None else None,
        "checksum": None if args.no_checksum or index is None else checksum(index),
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
