"""The reward for examples/openrlhf/run_grpo.sh, in the form OpenRLHF's ``--reward.remote_url`` takes
(a ``reward_func(queries, prompts, labels)`` file), named by ``HISTOSPEC_REMOTE_RM_URL`` because
OpenRLHF hands an agent executor no reward URL: 1 when the last ``\\boxed{...}`` of the response
equals the label, else 0. Replace it with your own; an HTTP reward server's URL works too."""

import re

import torch

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        answers = _BOXED.findall(query[len(prompt):] if query.startswith(prompt) else query)
        rewards.append(float(bool(answers) and answers[-1].strip() == str(label).strip()))
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
