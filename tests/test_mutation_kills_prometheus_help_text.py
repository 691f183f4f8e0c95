"""The Prometheus HELP line of every metric, word for word.

Dashboards and ``promtool`` show a metric's HELP text to operators, so it is
part of what ``AllocationStats.to_prometheus()`` promises; the existing tests
only require it to be non-empty. Pinned here so that a rewording is a
deliberate change (mutation testing found every HELP string unpinned).
"""

from __future__ import annotations

import pytest

from veloxquant_mlx.memory.block_pool import AllocationStats

HELP_TEXT = {
    "blocks": "Blocks managed by the pool.",
    "blocks_in_use": "Blocks checked out.",
    "peak_blocks_in_use": "High-water mark of blocks checked out.",
    "fragmentation_ratio": "Fraction of blocks checked out but partly filled.",
    "allocations_total": "Successful allocate calls.",
    "frees_total": "free and free_all calls that released a block handle.",
    "reused_total": "Blocks handed out again after a free.",
    "exhausted_total": "allocate and make_writable calls refused for lack of blocks.",
    "grown_total": "Blocks created by growth on exhaustion.",
    "retired_total": "Blocks retired by shrink.",
}


@pytest.mark.parametrize(("sample", "help_text"), sorted(HELP_TEXT.items()))
def test_prometheus_help_line_says_what_the_metric_measures(sample: str, help_text: str) -> None:
    lines = AllocationStats(n_blocks=8).to_prometheus().splitlines()
    assert f"# HELP veloxquant_block_pool_{sample} {help_text}" in lines
