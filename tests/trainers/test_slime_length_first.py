"""Length-first scheduling in the slime adapter: a rollout's requests reach the inner generate (and
so the engines) longest predicted first. slime's own rollout is exercised with it in
tests/trainers/test_slime.py; here the order is checked with the inner generate stood in by a recorder."""

from __future__ import annotations

import asyncio
import types

import pytest

from histospec_sgl.integrations import slime as adapter
from histospec_sgl.specrl.store import shared


def _sample(prompt: str, index: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(prompt=prompt, index=index, metadata={}, session_id=None)


def test_gate_releases_longest_predicted_first_then_unknown_in_arrival_order():
    order: list[str] = []

    async def main() -> None:
        gate = adapter.LengthFirstGate(window=0.01)

        async def req(name: str, predicted: float | None) -> None:
            await gate.wait_turn(predicted)
            order.append(name)

        await asyncio.gather(req("short", 10), req("unknown-1", None), req("long", 500), req("mid", 90),
                             req("unknown-2", None))

    asyncio.run(main())
    assert order == ["long", "mid", "short", "unknown-1", "unknown-2"]


def _previous(lengths: dict[str, tuple[int, ...]]) -> None:
    """Records each prompt's previous responses, one per slot, with the given lengths."""
    for prompt, per_slot in lengths.items():
        group = adapter.sample_group(_sample(prompt, 0))
        for slot, length in enumerate(per_slot):
            shared().record(None, [1, 2], list(range(length)), [-0.1] * length, "stop", group=group, slot=slot,
                            version=0)


def _rollout_order(monkeypatch, prompts: list[str], n: int, length_first: bool = True) -> list[str]:
    """The prompts in the order slime's generate hands their samples to the inner generate, when
    the rollout submits every sample at once, in data order."""
    calls: list[str] = []

    async def inner(args, sample, params):
        calls.append(sample.prompt)
        return sample

    monkeypatch.setattr(adapter, "_load_inner", lambda path: inner)
    args = types.SimpleNamespace(histospec_mode="history", histospec_length_first=length_first,
                                 n_samples_per_prompt=n, histospec_length_first_window=0.01)

    async def rollout() -> None:
        await asyncio.gather(*(adapter.generate(args, _sample(p, i), {"max_new_tokens": 8})
                               for i, p in enumerate(p for p in prompts for _ in range(n))))

    asyncio.run(rollout())
    return calls


def test_generate_orders_a_rollout_by_the_groups_previous_lengths(monkeypatch):
    n = 2
    _previous({"p-short": (5, 6), "p-long": (300, 301), "p-mid": (40, 41)})
    prompts = ["p-short", "p-long", "p-new", "p-mid"]
    assert _rollout_order(monkeypatch, prompts, n) == ["p-long"] * n + ["p-mid"] * n + ["p-short"] * n + ["p-new"] * n
    # Off (the default), requests go in as they come.
    assert _rollout_order(monkeypatch, prompts, n, length_first=False) == [p for p in prompts for _ in range(n)]
    with pytest.raises(ValueError, match="histospec_length_first"):
        adapter.Settings.from_args(types.SimpleNamespace(histospec_length_first="sometimes"))


def test_groups_go_by_their_expected_longest_sample_not_their_mean(monkeypatch):
    # "p-even" answered 100 and 100 tokens (mean 100, longest of two 100); "p-spread" 10 and 150
    # (mean 80, but the longest of two draws is 0.25 * 10 + 0.75 * 150 = 115): a group ends with its
    # longest sample, so "p-spread" goes first.
    _previous({"p-even": (100, 100), "p-spread": (10, 150)})
    assert _rollout_order(monkeypatch, ["p-even", "p-spread"], 2) == ["p-spread"] * 2 + ["p-even"] * 2
