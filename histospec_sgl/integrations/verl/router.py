"""A prompt-affinity load balancer for verl: every sample of a prompt, in every epoch, goes to the
same rollout server, so that per-engine history (HISTORY without a draft server) sees the whole group.

verl loads it from ``actor_rollout_ref.rollout.router_config_path``, a YAML file such as::

    router_class: histospec_sgl.integrations.verl.router.PromptAffinityLoadBalancer
    max_imbalance: 2.0     # optional: past this many times the mean load, fall back to least-loaded

It is verl's own sticky, least-in-flight balancer (``GlobalRequestLoadBalancer``) with one change:
a request it has not seen goes to the server that rendezvous hashing picks for its prompt (or for the
group named in its request id, :func:`request_id_for`, as the SPEC-RL agent loop sends them; stable
when servers are added or removed: only the prompts of a removed server move), unless that server
holds more than ``max_imbalance`` times the mean number of requests in flight (plus 8), where it
falls back to the least loaded one. Later calls with the same request id (multi-turn, SPEC-RL's
continuation) stay on the server of the first.

With a draft server every engine sees every group anyway; this balancer then only improves the
radix cache's hit rate.
"""

from __future__ import annotations

import hashlib
from typing import Any

from histospec_sgl.integrations.versions import require

require("verl")

from verl.workers.rollout.router import GlobalRequestLoadBalancer

from histospec_sgl import group_key

#: Request ids of the form ``histospec-<group hex>-<anything>`` carry their group: a SPEC-RL scoring call
#: sends prompt + previous response, and still belongs with its prompt.
REQUEST_PREFIX = "histospec-"


def request_id_for(group: int, unique: str) -> str:
    return f"{REQUEST_PREFIX}{group:016x}-{unique}"


def affinity_key(request_id: str, prompt_ids: list[int]) -> int:
    if request_id.startswith(REQUEST_PREFIX):
        try:
            return int(request_id[len(REQUEST_PREFIX):].split("-", 1)[0], 16)
        except ValueError:
            pass
    return group_key([int(t) for t in prompt_ids])


def _score(key: int, server_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}:{server_id}".encode(), digest_size=8).digest(), "little")


class PromptAffinityLoadBalancer(GlobalRequestLoadBalancer):
    def __init__(self, servers: dict[str, Any], yaml_config: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(servers, **kwargs)
        cfg = dict(yaml_config or {})
        self.max_imbalance = float(cfg.get("max_imbalance", 2.0))
        if self.max_imbalance < 1.0:
            raise ValueError(f"max_imbalance must be at least 1, got {self.max_imbalance}")
        self.affinity_hits = 0
        self.fallbacks = 0

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def acquire_server(self, request_id: str, prompt_ids: list[int] | None = None, **_: Any) -> tuple[str, Any]:
        sticky = self._request_id_to_server.get(request_id)
        if sticky is not None and sticky in self._inflight_requests:
            self._inflight_requests[sticky] += 1
            return sticky, self._servers[sticky]
        if not prompt_ids or not self._inflight_requests:
            return super().acquire_server(request_id)
        key = affinity_key(request_id, prompt_ids)
        server_id = max(self._inflight_requests, key=lambda sid: _score(key, sid))
        loads = self._inflight_requests
        if loads[server_id] > self.max_imbalance * (sum(loads.values()) / len(loads)) + 8:
            self.fallbacks += 1
            return super().acquire_server(request_id)
        self.affinity_hits += 1
        self._request_id_to_server[request_id] = server_id
        loads[server_id] += 1
        return server_id, self._servers[server_id]

    def affinity_stats(self) -> dict[str, int]:
        return {"affinity_hits": self.affinity_hits, "fallbacks": self.fallbacks}
