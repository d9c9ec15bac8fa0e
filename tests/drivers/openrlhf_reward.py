"""A reward function file for OpenRLHF's executor tests (``reward_func(queries, prompts, labels)``, the
form OpenRLHF's ``--reward.remote_url`` accepts): the length of the response text, modulo 2."""

import torch


def reward_func(queries, prompts, labels):
    rewards = torch.tensor([float(len(q) - len(p)) % 2 for q, p in zip(queries, prompts)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
