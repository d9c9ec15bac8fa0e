"""One of two torch.distributed ranks (gloo) sharing rank 0's drafts through the plugin's
DraftBroadcast, step after step; argv: rank, port, output JSON (tests/engine/test_plugin.py)."""

import json
import sys

import numpy as np
import torch.distributed as dist

from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.drafter import BatchDrafter, StepDraft
from histospec_sgl.plugin.tp import DraftBroadcast

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
g = dist.new_group([0, 1], backend="gloo")
bc = DraftBroadcast(g, src=0, rank_in_group=rank, world_size=2)
d, bs = 8, 3
dr = BatchDrafter(d, HistoryConfig(control="fixed")) if bc.is_source else None
got = []
for step in range(20):
    if dr is not None:
        if step == 0:
            for k in range(bs):
                dr.add_finished([1, 2, 3], [10 + k, 11, 12, 13, 14, 15])
        for k in range(bs):
            dr.sync(f"r{k}", [1, 2, 3], [10 + k, 11, 12, 13, 14, 15][: 1 + step % 5])
        if step == 7:
            # rank 0's drafting failed: it sends the empty draft
            sent = StepDraft(np.zeros(bs * d, np.int64), np.tile(np.tril(np.ones((d, d), np.int64)).ravel(), bs),
                             d, False)
        else:
            sent = dr.draft([f"r{k}" for k in range(bs)])
        step_draft = bc.share(sent, bs, d)
    else:
        step_draft = bc.share(None, bs, d)
    got.append([step_draft.tokens.tolist(), step_draft.mask.tolist(), step_draft.width, step_draft.drafted])
json.dump(got, open(out, "w"))
dist.destroy_process_group()
