"""Builds an index, drafts, and prints (JSON) whether huge pages are in force, the drafts and how much
memory is advised for huge pages (tests/unit/test_huge_pages.py)."""

import json

import numpy as np

import histospec_sgl as hs

rng = np.random.default_rng(7)
ix = hs.HistoryIndex()
truths = []
for g in range(4):
    base = rng.integers(1, 400, 5000)
    for _ in range(12):
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
    "tokens": tokens.tolist(),
    "mask": mask.tolist(),
    "advised_kb": advised,
    "index_bytes": ix.stats()["bytes"],
}))
