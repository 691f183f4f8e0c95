"""Every command refuses bad input in one line naming the value, with status 2.

The commands: ``veloxquant-mlx simulate`` and ``stress`` (also ``python -m
stress``), ``python -m veloxquant_mlx.testing.aliasing``, ``...testing.exhaustive``,
``...stress.schedules`` and ``...stress.finaliser_schedules``. Bad input is
refused before anything is allocated or written: a huge store header, pool
or search is refused by its estimated size (only what cannot fit in the
machine's memory: the defaults run on an 8 GB machine), a number beyond any
float is one line too, an ``--out`` that cannot be used leaves nothing
behind. (Ctrl-C: ``test_commands_on_ctrl_c.py``.)
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from veloxquant_mlx import cli
from veloxquant_mlx.commandline import bad_input
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress import finaliser_schedules, schedules_command
from veloxquant_mlx.stress.cli import config_from, memory_estimate
from veloxquant_mlx.stress.config import OPERATION_KINDS, PROFILES, STORE_KINDS, profile
from veloxquant_mlx.testing import (
    aliasing,
    driver_command,
    exhaustive,
    exhaustive_command,
    replay_command,
)
from veloxquant_mlx.testing.exhaustive_command import default_max_states
from veloxquant_mlx.testing.exhaustive_command import memory_estimate as exhaustive_memory
from veloxquant_mlx.testing.traces import StoreSpec, Trace, TraceLine, dumps, load, save
from veloxquant_mlx_spec.operations import Allocate, Free
from veloxquant_mlx_spec.table import Returned, h

#: What an 8 GB laptop reports as its memory (MemTotal: the kernel keeps some).
LAPTOP_BYTES = 7_800 * 2**20
#: A driver that answers its start with a line that is not the protocol's hello.
SAYS_HI = shlex.join([sys.executable, "-c", "print('hi')"])
#: A driver that says no hello for longer than any timeout a test sets.
SAYS_HI_LATE = shlex.join([sys.executable, "-c", "import time; time.sleep(30)"])
#: A driver whose hello nests arrays deeper than the JSON parser recurses.
SAYS_DEEP = shlex.join([sys.executable, "-c", "print('[' * 100_000 + ']' * 100_000)"])
HUGE = "1" + "0" * 400  # beyond any float: once an OverflowError traceback in every command
HEADER = {
    "trace": "veloxquant-mlx",
    "version": 1,
    "pool": {
        "block_size": 4,
        "n_blocks": 8,
        "separate_kv": True,
        "grow_on_exhaustion": False,
        "max_blocks": None,
    },
    "store": {"n_layers": 2, "n_kv_heads": 1, "head_dim": 2, "dtype": "float32"},
}

Main = Callable[[Sequence[str]], int]
#: A stress mix whose every pool call has weight 0: only the store's calls are left.
ONLY_STORE_CALLS = ",".join(f"{kind}=0" for kind in OPERATION_KINDS if kind not in STORE_KINDS)


def header_with(**store: object) -> str:
    return json.dumps({**HEADER, "store": {**HEADER["store"], **store}}) + "\n"  # type: ignore[dict-item]


def refused(
    capsys: pytest.CaptureFixture[str], main: Main, args: Sequence[str], *fragments: str
) -> str:
    """Run ``main(args)``; it must exit 2 with one error line holding every fragment."""
    assert main(list(args)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert ": error: " in captured.err
    for fragment in fragments:
        assert fragment in captured.err
    return captured.err


# -- the aliasing replay's command line --------------------------------------------------------


@pytest.mark.parametrize(
    ("contents", "fragment"),
    [
        (None, "No such file or directory"),
        ("", "empty trace"),
        (header_with(dtype="float99"), "got 'float99'"),
        (header_with(n_layers="two"), "n_layers must be an int >= 1, got 'two'"),
        (header_with(n_layers=True), "n_layers must be an int >= 1, got True"),
        (header_with(n_layers=100_000_000_000), "n_layers=100000000000"),
        (header_with(n_layers=10**400), "needs about 2**"),
        (header_with() + '{"op": "bogus"}\n', "line 2: 'op' must be one of"),
        ('{"trace": "other"}\n', 'expected a header {"trace": "veloxquant-mlx", "version": 2'),
        (header_with() + '{"op": "n_free", "stream": ' + "9" * 5000 + "}\n", "line 2: not JSON"),
        ('{"trace": "veloxquant-mlx", "x": ' + "1" * 5000 + "}\n", "header is not JSON"),
        (header_with() + "[" * 200_000 + "]" * 200_000 + "\n", "line 2: not JSON: nested too"),
        ("[" * 200_000 + "\n", "header is not JSON: nested too deeply"),
        (header_with() + '{"op": "n_free", "stream": NaN}\n', "line 2: a number must be finite"),
        (header_with() + '{"op": "n_free", "stream": 1e400}\n', "must be finite, got 1e400"),
        (
            header_with()
            + '{"op": "allocate", "call": 0, "stream": "k", "n_tokens": 5, "owner": 1}\n'
            + '{"op": "write", "layer": 0, "block": [0, 0], "start": 0, '
            + '"n_tokens": 10000000000000}\n',
            "and a write of n_tokens=10,000,000,000,000 needs about",
        ),
        # Once a file cut at a line's end replayed its first lines and said ok.
        (
            json.dumps({**HEADER, "lines": 2})
            + '\n{"op": "n_free", "stream": "k", "expect": "ok", "returned": 4}\n',
            "line 1: the header counts 2 call lines, the file holds 1",
        ),
        (json.dumps({**HEADER, "lines": -1}) + "\n", 'header "lines" must be an int >= 0'),
    ],
    ids=[
        "missing",
        "empty",
        "unknown-dtype",
        "n_layers-two",
        "n_layers-bool",
        "n_layers-huge",
        "n_layers-beyond-floats",
        "bad-op",
        "not-a-trace",
        "int-of-5000-digits",
        "int-of-5000-digits-in-the-header",
        "arrays-nested-200000-deep",
        "header-nested-200000-deep",
        "nan",
        "a-float-beyond-any-float",
        "a-write-too-big",
        "cut-short",
        "lines-negative",
    ],
)
def test_the_aliasing_cli_refuses_a_bad_trace_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], contents: str | None, fragment: str
) -> None:
    path = tmp_path / "trace.jsonl"
    if contents is not None:
        path.write_text(contents)
    refused(capsys, aliasing.main, [str(path)], str(path), fragment)


def test_the_aliasing_cli_refuses_a_folder_and_bfloat16_on_numpy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(capsys, aliasing.main, [str(tmp_path)], "Is a directory")
    path = tmp_path / "bf16.jsonl"
    path.write_text(header_with(dtype="bfloat16"))
    refused(capsys, aliasing.main, [str(path), "--backend", "numpy"], "got 'bfloat16'")


@pytest.mark.parametrize("backend", ["spec", "pool", "numpy"])
def test_replay_refuses_a_trace_naming_a_handle_no_call_handed_out(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Once the spec replayed it as a stale handle and said ok, and the pool said FAILED.
    path = tmp_path / "typo.jsonl"
    path.write_text(
        json.dumps({**HEADER, "version": 2})
        + '\n{"op": "mark_used", "block": [5, 0], "n_used": 1, "expect": "ok"}\n'
    )
    refused(capsys, cli.main, ["replay", str(path), "--on", backend], "typo.jsonl", "h(5, 0)")


@pytest.mark.parametrize("backend", ["spec", "pool", "numpy"])
def test_replay_refuses_a_pool_too_big_for_memory_on_every_backend(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Once the spec and pool replays built it: a MemoryError traceback, status 1.
    path = tmp_path / "big.jsonl"
    huge = {**HEADER["pool"], "n_blocks": 100_000_000_000}  # type: ignore[dict-item]
    path.write_text(json.dumps({**HEADER, "version": 2, "pool": huge}) + "\n")
    refused(capsys, cli.main, ["replay", str(path), "--on", backend], "n_blocks=100000000000")


def test_replay_refuses_a_stream_with_no_size_once_it_gives_more_than_fits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A device or a pipe has no size to refuse it by: /dev/zero was read whole (5 GB and
    # on) until the process was killed. It is now read up to a tenth of the memory.
    monkeypatch.setattr(replay_command, "physical_memory_bytes", lambda: 10_000)
    refused(
        capsys,
        cli.main,
        ["replay", "/dev/zero", "--on", "spec"],
        "/dev/zero: a trace of more than 1,000 bytes needs more memory, once parsed, than",
    )


def test_a_bounded_load_of_a_small_trace_reserves_only_what_it_reads(tmp_path: Path) -> None:
    # read(n) reserves n bytes at once: with a bound of a tenth of the memory, every replay
    # reserved that much (a MemoryError traceback under ulimit -v, for a 235-byte trace).
    path = tmp_path / "small.jsonl"
    save(Trace(PoolConfig(block_size=4, n_blocks=8), StoreSpec(1, 1, 2)), path)
    assert load(path, max_bytes=2**62).pool == PoolConfig(block_size=4, n_blocks=8)


def test_a_bad_trace_among_good_ones_is_refused_before_any_is_replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.jsonl"
    save(Trace(PoolConfig(block_size=4, n_blocks=8), StoreSpec(1, 1, 2)), good)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(header_with(dtype="float99"))
    refused(capsys, aliasing.main, [str(good), str(bad), "--backend", "numpy"], "bad.jsonl")


def test_the_aliasing_cli_tells_a_violation_from_bad_input_and_a_partial_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = PoolConfig(block_size=4, n_blocks=8)
    violation = tmp_path / "violation.jsonl"
    ops = (
        TraceLine(Allocate("k", 2, 1), 0),
        TraceLine(Free((h(0, 0),))),
        TraceLine(Free((h(0, 0),)), outcome=Returned(None)),
    )
    save(Trace(pool, StoreSpec(1, 1, 2), ops), violation)
    assert aliasing.main([str(violation), "--backend", "numpy"]) == 1
    assert "FAILED" in capsys.readouterr().err
    partial = tmp_path / "partial.jsonl"
    partial.write_text(dumps(Trace(pool, StoreSpec(1, 1, 2), ops[:2], partial=True)))
    assert aliasing.main([str(partial), "--backend", "numpy"]) == 3
    assert "INCONCLUSIVE" in capsys.readouterr().out


# -- stress --------------------------------------------------------------------------------------


def stress(*args: str) -> list[str]:
    return ["stress", "--ops", "100", "--no-progress", *args]


def test_stress_refuses_an_empty_out_rather_than_writing_into_the_current_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    refused(capsys, cli.main, stress("--out", ""), "argument --out", "got ''")
    assert list(tmp_path.iterdir()) == []


def test_stress_refuses_an_out_it_cannot_create_and_leaves_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(capsys, cli.main, stress("--out", "/proc/x"), "'/proc/x'", "cannot be created")
    refused(capsys, cli.main, stress("--out", str(blocker / "x" / "y")), "cannot be created")
    refused(capsys, cli.main, stress("--out", str(blocker)), "is a file")
    assert [path.name for path in tmp_path.iterdir()] == ["file"]


def test_an_empty_trace_path_is_refused_naming_it_not_the_current_folder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It was read as '.': ".: cannot read the trace: Is a directory".
    refused(capsys, cli.main, ["replay", ""], "argument traces", "expected a file path, got ''")
    refused(capsys, cli.main, ["stress", "--replay", ""], "argument --replay", "got ''")


def test_stress_refuses_an_out_whose_name_cannot_be_used_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Each was a traceback: a name past the file system's 255 bytes (OSError), bytes that
    # are not UTF-8 (the summary failed to be written after the whole run), and a folder
    # by a run file's name under --force (IsADirectoryError).
    long_name = str(tmp_path / ("a" * 300))
    refused(capsys, cli.main, stress("--out", long_name), "cannot be used: File name too long")
    not_utf8 = os.fsdecode(bytes(tmp_path) + b"/\xff\xfe")
    refused(capsys, cli.main, stress("--out", not_utf8), "argument --out", "in UTF-8")
    (tmp_path / "report.json").mkdir()
    forced = stress("--out", str(tmp_path), "--force")
    refused(capsys, cli.main, forced, "holds a folder named 'report.json'", "files only")
    assert [path.name for path in tmp_path.iterdir()] == ["report.json"]


def test_stress_refuses_a_reused_out_unless_forced_and_then_keeps_no_stale_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stale = tmp_path / "violation-linearizability.json"
    stale.write_text('{"stale": true}')
    (tmp_path / "notes.txt").write_text("mine")
    refused(capsys, cli.main, stress("--out", str(tmp_path)), "earlier run's files", "--force")
    assert stale.exists()
    assert cli.main(stress("--out", str(tmp_path), "--force", "--storage", "none")) == 0
    capsys.readouterr()
    assert not stale.exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "ok"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--n-blocks", "100000000000", "--no-grow"], "--n-blocks 100000000000"),
        (["--search-budget", "10000000000"], "--search-budget 10000000000"),
        (["--threads", "0"], "argument --threads: expected an int from 1 to 1024, got '0'"),
        (["--threads", "100000"], "got '100000'"),
        (["--check-budget", "0"], "argument --check-budget: expected a finite number > 0, got '0'"),
        (["--mix", "allocate=lots"], "allocate=lots"),
        (["--window-ops", "100000000000"], "expected an int from 1 to 1000"),
        # Once accepted: the workers then crashed in random.choices (int too large for a
        # float), and the run reported the harness's crash as a violation of the pool.
        (["--mix", "write=" + "9" * 500], "'write' must be at most 2**63-1, got '99999"),
        (["--mix", "write=9223372036854775808"], "got '9223372036854775808'"),
    ],
)
def test_stress_refuses_bad_options_before_creating_its_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], fragment: str
) -> None:
    out = tmp_path / "run"
    refused(capsys, cli.main, stress("--out", str(out), *args), fragment)
    assert not out.exists()


def test_stress_replay_refuses_what_is_not_a_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    refused(capsys, cli.main, ["stress", "--replay", str(tmp_path / "nope")], "No such file")
    refused(capsys, cli.main, ["stress", "--replay", str(tmp_path)], "Is a directory")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    refused(capsys, cli.main, ["stress", "--replay", str(garbage)], "not a trace")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--no-grow", "--max-blocks", "50"], "--max-blocks 50 has no effect on a pool that"),
        (["--n-blocks", "100"], "--n-blocks 100 is above the profile's cap of growth, max_blocks"),
        (["--force"], "--force has no effect without --out"),
        (["--mix", "allocate=1,allocate=5"], "'allocate' is given twice"),
        (["--mix", " , "], "expected kind=weight items, got ' , '"),
        (["--storage", "none", "--mix", "gather=3"], "gather=3 has no effect with --storage none"),
        # Once accepted, and every worker crashed drawing from a mix with no kind left.
        (["--storage", "none", "--mix", ONLY_STORE_CALLS], "write and gather alone makes no call"),
    ],
)
def test_stress_names_the_pool_options_that_conflict(
    capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    refused(capsys, cli.main, ["stress", *args], fragment)


def test_stress_no_grow_drops_the_profiles_cap_so_any_n_blocks_fits() -> None:
    parser, _ = cli.build_parser()
    config = config_from(parser.parse_args(["stress", "--no-grow", "--n-blocks", "100"]))
    assert (config.pool.n_blocks, config.pool.grow_on_exhaustion) == (100, False)
    assert config.pool.max_blocks is None


def test_stress_replay_refuses_the_run_options_it_would_ignore(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "t.jsonl"
    allocate = TraceLine(Allocate("k", 5, 1), 0)
    save(Trace(PoolConfig(block_size=4, n_blocks=8), StoreSpec(1, 1, 2), (allocate,)), trace)
    replay = ["stress", "--replay", str(trace)]
    refused(
        capsys,
        cli.main,
        [*replay, "--search-budget", "1", "--threads", "8", "--json"],
        "so --threads, --search-budget, --json would have no effect; leave them out (a "
        "replay's search budget is veloxquant-mlx replay FILE --budget N) (see --help)\n",
    )
    # The pointer to replay's --budget comes only with --search-budget.
    refused(capsys, cli.main, [*replay, "--seed", "0"], "no effect; leave them out (see --help)\n")
    assert cli.main([*replay, "--replay-backend", "numpy", "--no-progress"]) == 0
    assert capsys.readouterr().out == f"{trace}: 1 ops replayed on numpy: ok\n"


# -- simulate, exhaustive, schedules ----------------------------------------------------------


@pytest.mark.parametrize(
    ("main", "args", "fragment"),
    [
        (cli.main, ["simulate", "--n-blocks", "100000000000"], "--n-blocks 100000000000"),
        (cli.main, ["simulate", "--requests", "1000000000000"], "--requests 1000000000000"),
        # Each was an int(inf) traceback: the estimate overflowed the largest float.
        (cli.main, ["simulate", "--arrival-rate", "5e-324", "--requests", "1"], "2**1024 bytes"),
        (
            cli.main,
            ["simulate", "--duration", "9223372036854775807", "--arrival-rate", "1e300"],
            "2**1024",
        ),
        (exhaustive.main, ["--depth", "-1"], "argument --depth: expected an int >= 0, got '-1'"),
        (exhaustive.main, ["--max-states", "100000000000"], "--max-states 100000000000"),
        (exhaustive.main, ["--scope", "nowhere"], "invalid choice: 'nowhere'"),
        (exhaustive.main, ["--factory", "nowhere:Pool"], "cannot import 'nowhere'"),
        (exhaustive.main, ["--factory", "json"], "expected module:callable, got 'json'"),
        (exhaustive.main, ["--factory", "json:nothing"], "'json' has no 'nothing'"),
        (exhaustive.main, ["--driver", "'unclosed"], "--driver: cannot split"),
        (exhaustive.main, ["--driver", " "], "--driver: expected a command line, got ' '"),
        (exhaustive.main, ["--driver", "no-such-driver-here"], "cannot start"),
        (exhaustive.main, ["--driver", SAYS_HI], "it wrote b'hi', not a JSON object"),
        (
            exhaustive.main,
            ["--driver", SAYS_DEEP],
            "[[[', nested too deeply to read, for the hello line",
        ),
        (exhaustive.main, ["--driver", "x", "--factory", "json:dumps"], "not allowed with"),
        (exhaustive.main, ["--driver-timeout", "5"], "--driver-timeout has no effect without"),
        # Past about 2**31 s, epoll's wait overflowed: a traceback, status 1.
        (
            exhaustive.main,
            ["--driver", "x", "--driver-timeout", "3e6"],
            "--driver-timeout: expected a number > 0 and <= 86400, got '3e6'",
        ),
        (
            exhaustive.main,
            ["--driver", SAYS_HI_LATE, "--driver-timeout", "0.3"],
            "no answer within 0.3 s (waiting for the hello line)",
        ),
        (exhaustive.main, ["--force"], "--force has no effect without --out"),
        (cli.main, ["driver", "--factory", "nowhere:Pool"], "cannot import 'nowhere'"),
        (driver_command.main, ["--factory", "json"], "expected module:callable, got 'json'"),
        (cli.main, ["stress", "--check-interval", "1e10"], "<= 3600, got '1e10'"),
        # Once a false deadlock: the watchdog looks every 0.1 s.
        (cli.main, ["stress", "--stall-timeout", "0.05"], "a finite number >= 1, got '0.05'"),
        # Once accepted, and CPython stored 0.0 while the report said 1e+300.
        (cli.main, ["stress", "--switch-interval", "1e300"], "<= 1, got '1e300'"),
        (schedules_command.main, ["--max-preemptions", "-1"], "got '-1'"),
        (schedules_command.main, ["--max-schedules", "0"], "got '0'"),
    ],
)
def test_every_other_command_refuses_bad_input_in_one_line(
    capsys: pytest.CaptureFixture[str], main: Main, args: list[str], fragment: str
) -> None:
    refused(capsys, main, args, fragment)


@pytest.mark.parametrize(
    ("factory", "fragment"),
    [
        ("json:loads", "the port 'loads' raised TypeError: the JSON object must be str"),
        ("broken_factory:make", "the port 'make' raised RuntimeError: no pool today"),
        ("broken_syntax:make", "cannot import 'broken_syntax' (SyntaxError: "),
    ],
    ids=["wrong-signature", "raises", "syntax-error"],
)
def test_a_factory_that_cannot_build_a_pool_is_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    factory: str,
    fragment: str,
) -> None:
    (tmp_path / "broken_factory.py").write_text(
        "def make(config, history_len=None):\n    raise RuntimeError('no pool today')\n"
    )
    (tmp_path / "broken_syntax.py").write_text("def make(:\n")
    monkeypatch.chdir(tmp_path)
    args = ["--scope", "shared-4", "--depth", "1", "--factory", factory]
    assert exhaustive.main(args) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    [error_line] = [line for line in captured.err.splitlines() if ": error: " in line]
    assert captured.err.endswith(error_line + "\n")  # the last line; before it, progress only
    assert fragment in error_line


def test_stress_names_every_option_that_sizes_a_run_too_big(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = refused(
        capsys, cli.main, stress("--out", str(tmp_path / "run"), "--block-size", "10**11")
    )
    assert "argument --block-size" in err  # not an int: refused by its type
    err = refused(
        capsys, cli.main, stress("--out", str(tmp_path / "run"), "--block-size", "100000000000")
    )
    for option in ("--block-size 100000000000", "--n-blocks", "--threads", "--window-ops"):
        assert option in err
    assert "store: 2 layers of 1 x 2 float32 values per token" in err


@pytest.mark.parametrize(
    ("main", "args", "option"),
    [
        (cli.main, ["simulate", "--n-blocks", HUGE], "--n-blocks"),
        (cli.main, ["simulate", "--seed", HUGE], "--seed"),
        (cli.main, ["simulate", "--arrival-rate", HUGE], "--arrival-rate"),
        (cli.main, ["stress", "--search-budget", HUGE], "--search-budget"),
        (cli.main, ["stress", "--ops", HUGE], "--ops"),
        (exhaustive.main, ["--max-states", HUGE], "--max-states"),
        (exhaustive.main, ["--depth", "9" * 5000], "--depth"),  # more digits than int() reads
        (schedules_command.main, ["--max-schedules", HUGE], "--max-schedules/--max-runs"),
        (finaliser_schedules.main, ["--max-runs", HUGE], "--max-schedules/--max-runs"),
    ],
)
def test_a_number_beyond_any_float_is_one_short_line_on_every_command(
    capsys: pytest.CaptureFixture[str], main: Main, args: list[str], option: str
) -> None:
    err = refused(capsys, main, args, f"argument {option}: expected ", "characters)")
    assert len(err) < 200


def test_the_finaliser_explorer_refuses_a_bad_budget_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    refused(capsys, finaliser_schedules.main, ["--max-runs", "0"], "expected an int >= 1, got '0'")


# -- memory: refuse only what cannot fit --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_the_stress_profiles_fit_an_8_gb_machine(name: str) -> None:
    bad_input.require_fits_in_memory(memory_estimate(PROFILES[name]), name, limit=LAPTOP_BYTES)


def test_stress_refuses_only_what_exceeds_the_machine_not_what_is_free_now(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bad_input, "physical_memory_bytes", lambda: LAPTOP_BYTES)
    monkeypatch.setattr(bad_input, "available_memory_bytes", lambda: 2**30)  # a busy machine
    args = ["stress", "--profile", "nightly", "--ops", "50", "--no-progress", "--storage", "none"]
    assert cli.main([*args, "--replay-backend", "none", "--out", str(tmp_path)]) == 0
    assert "more than the 1 GiB free now" in capsys.readouterr().err  # said, not refused


def test_a_store_left_out_counts_no_memory_in_the_stress_estimate() -> None:
    # A 2**40-slot block size was refused as "about 5 PiB" with --storage none and
    # --replay-backend none, which build no store: the run needs a few MiB.
    huge = PoolConfig(block_size=2**40, n_blocks=24, grow_on_exhaustion=True, max_blocks=40)
    without = profile("smoke").with_options(pool=huge, storage="none", replay_backend="none")
    assert memory_estimate(without) < 2**30
    assert memory_estimate(without.with_options(storage="numpy")) > 2**50
    assert memory_estimate(without.with_options(replay_backend="numpy")) > 2**50


def test_the_exhaustive_defaults_fit_an_8_gb_machine(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert exhaustive_memory(default_max_states(LAPTOP_BYTES)) <= LAPTOP_BYTES // 2
    monkeypatch.setattr(exhaustive_command, "physical_memory_bytes", lambda: LAPTOP_BYTES)
    assert exhaustive.main(["--depth", "1", "--scope", "shared-4"]) == 0
    states = default_max_states(LAPTOP_BYTES)
    assert f"at most {states:,} states per scope" in capsys.readouterr().err


# -- the benchmarks: their options too are refused in one line --------------------------------

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(
    ("script", "args", "fragment"),
    [
        ("bench_kv_cache", ["--steps", "-1"], "--steps: expected an int >= 1, got '-1'"),
        ("bench_kv_cache", ["--mlx-cache-limit-mb", "-5"], "expected an int >= 0, got '-5'"),
        ("bench_cache_host", ["--contexts", "junk"], "--contexts: expected an int >= 1"),
        ("bench_cache_host", ["--against-tree", "/nonexist"], "'/nonexist': no checkout of"),
        ("bench_cache_host", ["--against-tree", ""], "'': no checkout of this project"),
        ("bench_cache_host", ["--against-tree", "."], "is this checkout; expected another"),
        ("bench_cache_host", ["--against", "HEAD", "--against-tree", "/x"], "not allowed with"),
        ("bench_block_pool", ["--callgrind"], "--callgrind has no effect without --compare"),
        ("bench_block_pool", ["--compare", "--compiled-site", "/nonexistent"], "not a folder"),
        ("bench_block_pool", ["--against", "no-such-rev"], "'no-such-rev': git worktree add"),
        ("bench_block_pool", ["--figures", "mark_used_ns"], "--figures has no effect without"),
        ("bench_block_pool", ["--against", "HEAD", "--compare"], "--compare has no effect with"),
        ("bench_paged_attention", ["--json", "/proc/x/y.json"], "in an existing folder"),
        ("bench_block_gather", ["--rounds", "0"], "--rounds and every context must be >= 1"),
        ("bench_slab_copy", ["--requests", "0"], "--requests: expected an int >= 1, got '0'"),
        ("bench_read_by_runs", ["--contexts", "100"], "must exceed --decoded 256, got 100"),
        ("bench_decode_overheads", ["--extra-nodes", "3"], "--extra-nodes must be even, got 3"),
        ("bench_decode_overheads", ["--rounds", "0"], "--rounds: expected an int >= 1, got '0'"),
    ],
)
def test_a_benchmark_refuses_a_bad_option_in_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    script: str,
    args: list[str],
    fragment: str,
) -> None:
    # Each was a traceback, a three-line usage block, a silent default or a figure from
    # a nonsense value (--steps -1 printed a negative throughput).
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [f"{script}.py"])
    main = importlib.import_module(script).main
    with pytest.raises(SystemExit) as ended:
        main(args)
    assert ended.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"{script}.py: error: ")
    assert fragment in line


@pytest.mark.parametrize(
    ("script", "args", "option"),
    [
        ("bench_kv_cache", ["--contexts", "100000000000", "--skip-memory"], "--contexts or"),
        ("bench_read_by_runs", ["--contexts", "100000000000"], "--contexts, --decoded or"),
        ("bench_slab_copy", ["--context", "100000000000"], "--context or --requests"),
        ("bench_slab_copy", ["--requests", "100000000000"], "--context or --requests"),
        ("bench_decode_overheads", ["--contexts", "100000000000"], "--contexts"),
    ],
)
def test_a_benchmark_refuses_a_context_too_large_for_the_machine_in_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    script: str,
    args: list[str],
    option: str,
) -> None:
    # Each was a 22-line traceback ending in the pool's MemoryError, status 1.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = importlib.import_module(script).main
    run_benchmark = importlib.import_module("_report").run_benchmark
    sizes = importlib.import_module(script).SIZE_OPTIONS  # what its __main__ passes
    assert run_benchmark(f"{script}.py", lambda: main(args), sizes) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{script}.py: error: a pool of n_blocks=")
    assert f"expected a smaller {option}" in line


def test_bench_cache_host_worker_refuses_a_context_too_large_with_status_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    main = importlib.import_module("bench_cache_host").main
    root = str(BENCHMARKS.parent)
    with pytest.raises(SystemExit) as ended:
        main(["--worker", root, "100000000000", "1", "1"])
    assert ended.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "a pool of n_blocks=" in line and line.endswith("(--contexts 100000000000)")


def test_bench_paged_attention_without_cuda_checks_nothing_and_says_inconclusive(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It exited 0, as if the kernel had been checked.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("bench_paged_attention")
    monkeypatch.setattr(module, "cuda_unavailable_reason", lambda: "no CUDA in this test")
    assert module.main(["--quick"]) == 3
    assert capsys.readouterr().out == (
        "fused kernel not checked, INCONCLUSIVE: no CUDA in this test\n"
    )
