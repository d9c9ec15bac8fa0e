"""HISTOSPEC_HUGE_PAGES=1: the index's large buffers on transparent huge pages, same drafts.

The allocator decides once per process, so each case runs in its own interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys
import numpy as np
import histospec_sgl as hs

if sys.argv[1:] == ["ask"]:
    assert hs.huge_pages(True)  # decided here, before any large buffer
rng = np.random.default_rng(7)
ix = hs.HistoryIndex()
truths = []
for g in range(4):
    base = rng.integers(1, 400, 5000)
    for r in range(12):
        resp = base.copy()
        flip = rng.random(len(resp)) < 0.05
        resp[flip] = rng.integers(1, 400, int(flip.sum()))
        ix.add_response(g, [g + 1, 7], resp.tolist(), 0)
    truths.append(resp)
rids = np.arange(100, 116)
for i, r in enumerate(rids):
    g = i % 4
    ix.begin_request(int(r), g, [g + 1, 7])
    ix.extend_request(int(r), truths[g][: 50 + 37 * i].tolist())
d = 16
tokens = np.zeros(len(rids) * d, np.int64)
mask = np.zeros(len(rids) * d * d, np.uint8)
ix.draft_batch(rids, d, tokens, mask)
advised = 0  # kB of mappings advised to use huge pages (VmFlags "hg")
size = 0
with open("/proc/self/smaps") as f:
    for line in f:
        if line.startswith("Size:"):
            size = int(line.split()[1])
        elif line.startswith("VmFlags:") and " hg" in line:
            advised += size
print(json.dumps({
    "on": hs.huge_pages(),
    "too_late": hs.huge_pages(not hs.huge_pages()),  # the first decision stands
    "tokens": tokens.tolist(),
    "mask": mask.tolist(),
    "advised_kb": advised,
    "index_bytes": ix.stats()["bytes"],
}))
"""


def _run(env_value: str | None, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HISTOSPEC_HUGE_PAGES"}
    if env_value is not None:
        env["HISTOSPEC_HUGE_PAGES"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are a Linux feature")
def test_huge_pages_change_where_buffers_live_not_what_is_drafted():
    off = _run(None)
    zero = _run("0")
    on = _run("1")
    assert (off["on"], zero["on"], on["on"]) == (False, False, True)
    # The same drafts, bit for bit.
    assert on["tokens"] == off["tokens"] and on["mask"] == off["mask"]
    assert any(t != 0 for t in on["tokens"])
    # With the switch on, the index's large buffers (several MiB here) are advised for huge pages;
    # off, nothing of ours is (numpy advises only arrays of 4 MiB and more; these are smaller).
    assert on["advised_kb"] * 1024 >= on["index_bytes"] // 2, on
    assert off["advised_kb"] < on["advised_kb"] // 4, (off, on)
    assert (off["too_late"], on["too_late"]) == (False, True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are a Linux feature")
def test_huge_pages_can_be_asked_for_in_code_before_the_first_index():
    asked = _run(None, "ask")
    assert asked["on"] and asked["too_late"]
    assert asked["advised_kb"] * 1024 >= asked["index_bytes"] // 2, asked


FORKER = r"""
import os, sys, threading
import numpy as np
import histospec_sgl as hs

assert hs.huge_pages(True)
stop = threading.Event()

def churn():
    # Builds and drops indexes: pool blocks are taken and given back all the time.
    rng = np.random.default_rng(1)
    while not stop.is_set():
        ix = hs.HistoryIndex()
        ix.add_response(0, [1], rng.integers(1, 300, 30000).tolist(), 0)
        del ix

t = threading.Thread(target=churn)
t.start()
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        # The child allocates from the pools at once; a lock held across fork would hang it here.
        ix = hs.HistoryIndex()
        ix.add_response(0, [1], list(range(1, 20000)), 0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
stop.set()
t.join()
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are a Linux feature")
def test_fork_while_another_thread_allocates_never_hangs_the_child():
    # The pools' lock is held across fork by the fork handlers, so a child never starts with it
    # taken by a thread it does not have.
    out = subprocess.run(
        [sys.executable, "-c", FORKER, "150"], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
