"""Helpers of ``histospec-sgl bench index``: the machine a run was measured on, the unkept wave, the latency keys."""

from __future__ import annotations

import os

import pytest

from histospec_sgl.bench import index_bench

THP = index_bench.THP_ENABLED


@pytest.mark.skipif(not os.path.exists(THP), reason=f"{THP} does not exist (not Linux, or no THP support)")
def test_thp_mode_is_the_bracketed_word_of_the_kernel_setting():
    with open(THP) as f:
        words = f.read().split()
    assert index_bench._thp_mode() in {w.strip("[]") for w in words}
    assert index_bench._thp_mode() in {"always", "madvise", "never"}


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux's /proc/self/smaps_rollup")
def test_anon_huge_bytes_is_the_kernels_anonhugepages_line_in_bytes():
    with open("/proc/self/smaps_rollup") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    got = index_bench._anon_huge_bytes()
    assert isinstance(got, int) and got >= 0
    # Both reads see the same mappings unless the kernel collapsed pages in between.
    assert abs(got - kib * 1024) <= 64 << 20


def test_unkept_wave_rebuilds_each_group_once_with_deferred_removal():
    from histospec_sgl.bench.workload import WorkloadSpec, generate

    w = generate(WorkloadSpec("tiny", prompts=3, siblings=4))
    got = index_bench.unkept_wave(w, {}, groups=2, step=50)
    assert got["finish_unkept_rebuilds_per_group_immediate"] == 4  # one per finished sibling
    assert got["finish_unkept_rebuilds_per_group_deferred"] == 1  # one, when the group is idle
    assert got["finish_unkept_ms_per_request_deferred"] > 0


def test_latency_reports_median_mean_and_p99_of_the_update():
    from histospec_sgl.bench.workload import W1, generate

    w = generate(W1, prompts=4)
    ix, _, _ = index_bench.ingest(w, {})
    r = index_bench.latency(ix, w, steps=6)
    assert r["latency_requests"] == 4 and r["latency_steps"] == 6
    for k in ("batch_draft_ms_per_step", "batch_draft_ms_compute", "batch_chain_ms_per_step",
              "update_ms_per_step", "update_ms_mean"):
        assert r[k] > 0, k
    assert r["update_ms_per_step"] <= r["update_ms_p99"] and r["update_ms_mean"] <= r["update_ms_p99"]
