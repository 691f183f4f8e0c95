"""Behaviour of the ``veloxquant-mlx`` command line, through ``cli.main``.

Exit statuses, usage errors that name the bad value, the ``--json`` schema and
its determinism and internal consistency, the table output, invariant checks
under ``--check-invariants``, and the two entry points (``python -m`` and the
console script).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from veloxquant_mlx import cli
from veloxquant_mlx.commandline import progress
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.simulate import command

QUICK = ["simulate", "--duration", "300", "--no-progress"]

DISTRIBUTION_KEYS = {"min", "mean", "median", "p95", "max", "count"}


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """Run ``simulate --json`` with ``args``; return the parsed stdout."""
    assert cli.main([*QUICK, "--json", *args]) == 0
    output = capsys.readouterr().out
    parsed: dict[str, Any] = json.loads(output)
    return parsed


def without_timings(document: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in document.items() if key != "timings"}


def prometheus_samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# -- output --------------------------------------------------------------------------


def test_bare_simulate_prints_the_sizing_table_and_prometheus_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["simulate"]) == 0
    captured = capsys.readouterr()
    for figure in (
        "peak blocks in use",
        "exhaustion events",
        "reuse ratio",
        "fragmentation",
        "wasted token slots",
        "admissions delayed",
        "decode tokens per step",
    ):
        assert figure in captured.out
    assert "# TYPE veloxquant_block_pool_allocations_total counter" in captured.out
    # No bar when stderr is not a terminal: at most a progress line every 10 s.
    assert all(line.startswith("simulate: step ") for line in captured.err.splitlines())


@pytest.mark.parametrize(
    ("pool", "caption"),
    [
        (["--n-blocks", "64"], "Peak capped by the pool size; rerun with --grow"),
        (  # once without a caption: a peak at the cap read as the demand
            ["--grow", "--n-blocks", "0", "--max-blocks", "100"],
            "Peak capped by --max-blocks; raise it, or leave it out",
        ),
        ([], None),  # never exhausted
        (["--grow", "--n-blocks", "0"], None),  # grows as far as the demand
    ],
)
def test_the_table_says_the_peak_was_capped_exactly_when_the_pool_refused_at_its_limit(
    capsys: pytest.CaptureFixture[str], pool: list[str], caption: str | None
) -> None:
    assert cli.main([*QUICK, *pool]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption may wrap
    if caption:
        assert caption in out
    else:
        assert "Peak capped" not in out


def test_a_series_with_no_sample_is_null_and_a_dash_never_a_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Once zeros: a run where nothing arrived, or nothing completed, showed latencies of 0.
    idle = ["--arrival-rate", "1e-9", "--duration", "5"]
    document = run_json(capsys, *idle)
    assert document["schema_version"] == 2
    assert document["requests"]["total"] == 0
    for series in ("latency_steps", "queue_wait_steps", "prompt_len", "decode_len"):
        assert document["requests"][series] is None
    assert document["pool"]["blocks_in_use"]["count"] == document["throughput"]["steps"]
    assert cli.main(["simulate", "--no-progress", *idle]) == 0
    captured = capsys.readouterr()
    latency = next(line for line in captured.out.splitlines() if "latency, steps" in line)
    assert [cell.strip() for cell in latency.split("│")[2:8]] == ["—"] * 5 + ["0"]
    assert captured.err == (
        "veloxquant-mlx simulate: warning: no request arrived in 5 steps at --arrival-rate "
        "1e-09: the figures are those of an idle pool; raise --duration or --arrival-rate\n"
    )


def test_the_lengths_drawn_are_reported_beside_the_means_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Once hidden: prompts asked to average 3,000 tokens were cut to the context window.
    document = run_json(capsys, "--prompt-mean", "3000")
    drawn = document["requests"]["prompt_len"]
    assert document["workload"]["prompt_mean"] == 3000
    assert drawn["max"] == 4095  # the context window less the one generated token
    assert drawn["mean"] < 2700
    assert cli.main([*QUICK, "--prompt-mean", "3000"]) == 0
    words = " ".join(capsys.readouterr().out.split())
    assert f"mean prompt / generated length │ {drawn['mean']:,.1f} / " in words
    assert "(asked 3,000 / 128)" in words


def test_the_tables_wrap_a_huge_figure_and_never_cut_it_short(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Once "36,893,4…": 2**63-token blocks waste more slots than a table cell showed.
    assert cli.main([*QUICK, "--block-size", str(2**63 - 1), "--n-blocks", "4"]) == 0
    captured = capsys.readouterr()
    assert "wasted token" in captured.out
    assert "…" not in captured.out


def test_prometheus_text_in_the_table_output_is_verbatim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(QUICK) == 0
    out = capsys.readouterr().out
    text = out[out.index("# HELP") :]
    assert text == run_json(capsys)["prometheus"]
    assert prometheus_samples(text)["veloxquant_block_pool_blocks"] == 1024


def test_json_has_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys)
    assert set(document) == {
        "schema_version",
        "seed",
        "pool_config",
        "workload",
        "run",
        "pool",
        "requests",
        "fragmentation",
        "wasted_slots",
        "throughput",
        "prometheus",
        "timings",
    }
    assert set(document["fragmentation"]) == DISTRIBUTION_KEYS
    assert set(document["wasted_slots"]["slots"]) == DISTRIBUTION_KEYS
    assert set(document["timings"]) == {"wall_seconds", "steps_per_second"}
    assert document["pool_config"] == {
        "block_size": 16,
        "n_blocks": 1024,
        "separate_kv": True,
        "grow_on_exhaustion": False,
        "max_blocks": None,
    }


def test_json_is_identical_across_runs_except_timings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = run_json(capsys, "--seed", "11", "--n-blocks", "200")
    second = run_json(capsys, "--seed", "11", "--n-blocks", "200")
    assert without_timings(first) == without_timings(second)


def test_different_seeds_give_different_runs(capsys: pytest.CaptureFixture[str]) -> None:
    first = run_json(capsys, "--seed", "1")
    second = run_json(capsys, "--seed", "2")
    assert first["requests"] != second["requests"]


def test_json_figures_agree_with_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "--n-blocks", "160", "--abort-fraction", "0.2")
    pool, requests = document["pool"], document["requests"]
    assert requests["completed"] + requests["aborted"] + requests["rejected"] == requests["total"]
    assert requests["aborted"] > 0
    assert pool["blocks_in_use_at_end"] == 0
    assert pool["peak_pct_of_pool"] == pytest.approx(100 * pool["peak_blocks_in_use"] / 160)
    assert pool["reuse_ratio"] == pytest.approx(pool["reused"] / pool["blocks_handed_out"])
    # Sampled at the end of each step, below the peak within a step at most.
    assert pool["blocks_in_use"]["max"] <= pool["peak_blocks_in_use"]
    assert requests["latency_steps"]["count"] == requests["completed"]
    assert requests["prompt_len"]["count"] == requests["total"]
    samples = prometheus_samples(document["prometheus"])
    assert samples["veloxquant_block_pool_allocations_total"] == pool["allocations"]
    assert samples["veloxquant_block_pool_exhausted_total"] == pool["exhausted"]
    assert samples["veloxquant_block_pool_frees_total"] == pool["frees"]
    assert samples["veloxquant_block_pool_blocks"] == pool["final_blocks"]
    assert document["throughput"]["arrival_steps"] == 300
    assert document["run"]["duration"] == 300


def test_tiny_pool_counts_exhaustion_and_says_the_peak_is_capped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = run_json(capsys, "--n-blocks", "48")
    assert document["pool"]["exhausted"] > 0
    assert document["requests"]["delayed_admissions"] > 0
    assert cli.main([*QUICK, "--n-blocks", "48"]) == 0
    assert "rerun with --grow" in capsys.readouterr().out


def test_a_pool_too_small_for_any_request_says_so_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Every request is rejected by a pool capped at no blocks: the report is still
    # printed (status 0), with one warning line that names the counts and the cap.
    args = ["--n-blocks", "0", "--grow", "--max-blocks", "0", "--json"]
    assert cli.main(["simulate", "--no-progress", "--requests", "20", *args]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["requests"]["rejected"] == 20
    assert captured.err.splitlines() == [
        "veloxquant-mlx simulate: warning: 20 of 20 requests were rejected: each needs "
        "more blocks than the pool's 0 can hold with no other request in it; "
        "raise --n-blocks, or --max-blocks with --grow"
    ]
    assert cli.main(["simulate", "--no-progress", "--requests", "20"]) == 0  # they fit
    assert capsys.readouterr().err == ""


def test_grow_option_grows_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "--n-blocks", "48", "--grow")
    assert document["pool"]["grown"] > 0
    assert document["pool"]["exhausted"] == 0
    assert document["pool"]["final_blocks"] == 48 + document["pool"]["grown"]
    assert document["pool_config"]["grow_on_exhaustion"] is True


def test_max_blocks_caps_growth(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "--n-blocks", "48", "--grow", "--max-blocks", "64")
    assert document["pool"]["final_blocks"] <= 64
    assert document["pool"]["exhausted"] > 0


def test_requests_option_bounds_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--requests", "25", "--json", "--no-progress"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["requests"]["total"] == 25
    assert parsed["run"]["requests"] == 25


def test_shared_kv_option_uses_one_free_list(capsys: pytest.CaptureFixture[str]) -> None:
    document = run_json(capsys, "--shared-kv")
    assert document["pool_config"]["separate_kv"] is False
    assert document["pool"]["blocks_in_use_at_end"] == 0


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal, as stderr in a shell would."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_is_drawn_on_stderr_when_it_is_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["simulate", "--duration", "300", "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["requests"]["total"]
    assert f"{total}/{total}" in terminal.getvalue()


def test_a_log_on_stderr_gets_progress_lines_instead_of_a_bar(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once a run whose stderr was a CI log showed nothing for as long as it ran.
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    assert cli.main(["simulate", "--duration", "300", "--json"]) == 0
    captured = capsys.readouterr()
    total = json.loads(captured.out)["requests"]["total"]
    lines = captured.err.splitlines()
    assert lines, "no progress line"
    for line in lines:
        assert re.fullmatch(rf"simulate: step [\d,]+, [\d,]+ of {total:,} requests, \d+ s", line)
    # At interval 0 every callback writes a line, the one at the end too.
    assert f"{total:,} of {total:,} requests" in lines[-1]


def test_no_progress_option_keeps_a_terminal_stderr_clean(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    run_json(capsys)  # QUICK includes --no-progress
    assert terminal.getvalue() == ""


# -- usage errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0"], "argument --block-size: expected an int >= 1, got '0'"),
        (["--n-blocks", "-3"], "argument --n-blocks: expected an int >= 0, got '-3'"),
        (["--n-blocks", "many"], "argument --n-blocks: expected an int >= 0, got 'many'"),
        (["--arrival-rate", "0"], "argument --arrival-rate: expected a finite number > 0, got '0'"),
        (
            ["--arrival-rate", "inf"],
            "argument --arrival-rate: expected a finite number > 0, got 'inf'",
        ),
        (
            ["--abort-fraction", "1.5"],
            "argument --abort-fraction: expected a number >= 0 and <= 1, got '1.5'",
        ),
        (["--prompt-dist", "pareto"], "argument --prompt-dist: invalid choice: 'pareto'"),
        (["--seed", "x"], "argument --seed: expected an int, got 'x'"),
        (["--duration", "0"], "argument --duration: expected an int >= 1, got '0'"),
        (["--duration", "5", "--requests", "5"], "not allowed with argument --duration"),
        (["--check-invariants", "0"], "expected an int >= 1, got '0'"),
        (["--max-blocks", "2000"], "--max-blocks 2000 has no effect without --grow"),
        (
            ["--grow", "--max-blocks", "10"],
            "--max-blocks must be >= --n-blocks (1024), got 10",
        ),
        (["--n-blocks", "0"], "--n-blocks 0 needs --grow"),
        (  # once accepted: K got 513 blocks and V 512, and the 513th K block was never used
            ["--n-blocks", "1025"],
            "--n-blocks must be even with separate K and V free lists (every request takes as "
            "many K blocks as V blocks, so an odd one is never used), got 1025; or pass "
            "--shared-kv",
        ),
        (["--grow", "--max-blocks", "2049"], "--max-blocks must be even with separate K and V"),
        (  # once silently ignored: decode lengths are geometric by default
            ["--decode-sigma", "2"],
            "--decode-sigma 2 has no effect with --decode-dist geometric",
        ),
        (
            ["--prompt-dist", "fixed", "--prompt-sigma", "0.5"],
            "--prompt-sigma 0.5 has no effect with --prompt-dist fixed",
        ),
        (
            ["--prompt-mean", "5000"],
            "--prompt-mean must be < --max-seq-len (4096), got 5000",
        ),
        (  # once accepted: every request was cut to the context window, the mean kept
            ["--decode-mean", "100000"],
            "--decode-mean must be < --max-seq-len (4096), got 100000",
        ),
        (  # once a traceback: the mean-keeping mu overflowed and a length came out NaN
            ["--prompt-sigma", "1e308"],
            "argument --prompt-sigma: expected a number >= 0 and <= 10, got '1e308'",
        ),
        (
            ["--decode-dist", "lognormal", "--decode-sigma", "11"],
            "argument --decode-sigma: expected a number >= 0 and <= 10, got '11'",
        ),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_option_exits_2_with_one_line_naming_the_value(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert cli.main(["simulate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("veloxquant-mlx simulate: error: ")
    assert captured.err.count("\n") == 1
    assert message in captured.err


def test_missing_subcommand_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "required: SUBCOMMAND" in capsys.readouterr().err


def test_an_option_before_any_subcommand_is_named_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--bogus-opt"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(
        "veloxquant-mlx: error: unrecognized arguments: --bogus-opt; expected a subcommand "
        "first (simulate, stress, exhaustive, replay, schedules, driver)"
    )
    assert cli.main(["--ops", "5", "stress"]) == 2
    assert "unrecognized arguments: --ops; expected a subcommand" in capsys.readouterr().err
    assert cli.main(["stres", "--ops", "5"]) == 2  # a mistyped subcommand is what is named
    assert "invalid choice: 'stres'" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0  # the top level's own options still work


def test_help_exits_0_and_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--block-size", "--n-blocks", "--shared-kv", "--grow", "--max-blocks"):
        assert option in out
    assert "(default: 1024)" in out


@pytest.mark.parametrize("subcommand", cli.SUBCOMMANDS, ids=lambda subcommand: subcommand.name)
def test_every_subcommand_is_listed_and_has_help(
    capsys: pytest.CaptureFixture[str], subcommand: cli.Subcommand
) -> None:
    assert cli.main(["--help"]) == 0
    assert f"\n    {subcommand.name}" in capsys.readouterr().out
    assert cli.main([subcommand.name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: veloxquant-mlx {subcommand.name} [-h]")
    words = " ".join(out.split())  # its lines wrapped anywhere
    assert "Exit status: 0 " in words and " 2 bad input" in words  # simulate's said none


# -- invariant checks ------------------------------------------------------------------


class CountingPool(BlockPoolAllocator):
    """Counts ``check_invariants`` calls; all instances share the count."""

    calls = 0

    def check_invariants(self) -> None:
        CountingPool.calls += 1
        super().check_invariants()


class BrokenPool(BlockPoolAllocator):
    def check_invariants(self) -> None:
        raise AssertionError("counters: blocks_in_use 3 != recount 2")


class PoolOutOfMemory(BlockPoolAllocator):
    """Its check runs out of memory at the 3rd call, as a pool too large for the machine did."""

    calls = 0

    def check_invariants(self) -> None:
        PoolOutOfMemory.calls += 1
        if PoolOutOfMemory.calls == 3:
            raise MemoryError
        super().check_invariants()


def test_check_invariants_runs_every_n_steps_and_at_the_end(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "BlockPoolAllocator", CountingPool)
    CountingPool.calls = 0
    document = run_json(capsys, "--check-invariants", "50")
    steps = document["throughput"]["steps"]
    assert CountingPool.calls == steps // 50 + 1
    assert document["run"]["check_invariants_every"] == 50


def test_invariants_are_checked_at_the_end_by_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "BlockPoolAllocator", CountingPool)
    CountingPool.calls = 0
    run_json(capsys)
    assert CountingPool.calls == 1


def test_bare_check_invariants_flag_checks_every_100_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = run_json(capsys, "--check-invariants")
    assert document["run"]["check_invariants_every"] == 100


def test_broken_invariant_exits_1_and_says_where(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "BlockPoolAllocator", BrokenPool)
    assert cli.main([*QUICK, "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "veloxquant-mlx simulate: error: invariant broken at step" in captured.err
    assert "blocks_in_use 3 != recount 2" in captured.err


def test_running_out_of_memory_exits_2_in_one_line_and_is_no_invariant_violation(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "BlockPoolAllocator", PoolOutOfMemory)
    PoolOutOfMemory.calls = 0
    assert cli.main([*QUICK, "--check-invariants", "50", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "veloxquant-mlx simulate: error: out of memory at step 150 with a pool of 1,024 "
        "blocks: these options need more memory than this machine has (ask for fewer "
        "--n-blocks, --max-blocks, --duration or --arrival-rate)\n"
    )


def test_pool_is_built_from_the_pool_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[PoolConfig] = []

    def record(config: PoolConfig) -> BlockPoolAllocator:
        built.append(config)
        return BlockPoolAllocator(config)

    monkeypatch.setattr(command, "BlockPoolAllocator", record)
    run_json(capsys, "--block-size", "8", "--n-blocks", "99", "--shared-kv", "--grow")
    assert built == [
        PoolConfig(
            block_size=8,
            n_blocks=99,
            separate_kv=False,
            grow_on_exhaustion=True,
            max_blocks=None,
        )
    ]


# -- entry points ------------------------------------------------------------------------


def test_python_dash_m_runs_simulate() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx", "simulate", "--requests", "10", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["requests"]["total"] == 10


def test_python_dash_m_exits_2_on_a_bad_option() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx", "simulate", "--block-size", "-1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    assert "expected an int >= 1, got '-1'" in result.stderr


def test_console_script_points_at_the_thin_entry_point() -> None:
    scripts = entry_points(group="console_scripts", name="veloxquant-mlx")
    assert [script.value for script in scripts] == ["veloxquant_mlx.__main__:main"]


def test_the_entry_points_import_nothing_heavy_before_the_ctrl_c_handler() -> None:
    """What runs before the handler is installed must be quick: a Ctrl-C there is a traceback."""
    probe = (
        "import sys, veloxquant_mlx.__main__, stress.__main__, veloxquant_mlx.commandline.sigint\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'mlx', 'argparse')\n"
        "         or m in ('veloxquant_mlx.cli', 'veloxquant_mlx.memory.block_pool')]\n"
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
