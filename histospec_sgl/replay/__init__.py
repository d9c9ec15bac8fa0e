"""Offline replay of rollout logs: tokens per verify step and projected speedup, ours and peers."""

from histospec_sgl.replay.data import PRESETS, FieldMap, ReplayDataError, Rollout, load_rollouts
from histospec_sgl.replay.measure import Tally, accept_greedy, run_method
from histospec_sgl.replay.run import ReplayOptions, run_replay
from histospec_sgl.replay.scenarios import SCENARIOS, Case, Selection, build_cases

__all__ = [
    "PRESETS",
    "SCENARIOS",
    "Case",
    "FieldMap",
    "ReplayDataError",
    "ReplayOptions",
    "Rollout",
    "Selection",
    "Tally",
    "accept_greedy",
    "build_cases",
    "load_rollouts",
    "run_method",
    "run_replay",
]
