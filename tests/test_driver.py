"""The JSON-lines driver: the kit and the exhaustive checker drive a port in another process.

Our own pool, served by ``veloxquant-mlx driver`` (``python -m
veloxquant_mlx.testing.driver``), passes the whole kit and the exhaustive
command through the protocol; a planted deviation served the same way is
found by both, and allowed by the kit's allow-list. A driver that dies,
writes junk or answers late ends the run with one ``DriverFailure`` naming
the driver, never a hang; on the command line, one line and status 2. So does a
response that breaks the protocol (a result where a ref belongs, an error that
is not an object), and our driver refuses a request line that is not a JSON
object the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from veloxquant_mlx import cli
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.testing.driven import (
    DrivenObjects,
    DriverFailure,
    DriverProcess,
    driven_port,
)
from veloxquant_mlx.testing.driver import PROTOCOL, PROTOCOL_VERSION
from veloxquant_mlx.testing.exhaustive import SCOPES, explore
from veloxquant_mlx.testing.port import ALL_CALLS
from veloxquant_mlx.testing.report import check_conformance, conformance_report

DRIVER = [sys.executable, "-m", "veloxquant_mlx.testing.driver"]
#: The subcommand's form, serving a pool with a planted bug (tests/planted_bugs.py).
PLANTED = [sys.executable, "-m", "veloxquant_mlx", "driver", "--factory"]
SEPARATE_4 = next(scope for scope in SCOPES if scope.name == "separate-4")
HELLO = json.dumps({"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "calls": sorted(ALL_CALLS)})


@pytest.mark.slow
def test_our_pool_passes_the_whole_kit_through_the_driver() -> None:
    # Every check of the kit, through the pipes; depth 1, since depth 2 takes 60-90 s over
    # pipes here (once cut by a 60-s budget: inconclusive, a failure) and the tests below
    # explore depth 2 through the driver. The budget is a cap, never reached.
    report = conformance_report(driven_port(DRIVER), depth=1, examples=10, time_budget=300)
    assert report.conforms, report.render()


def test_the_exhaustive_checker_drives_a_port_through_the_driver() -> None:
    result = explore(SCOPES[1], 2, driven_port(DRIVER))
    assert result.counterexample is None, str(result.counterexample)
    assert result.states > 10


def test_a_port_error_comes_back_as_its_contract_class() -> None:
    port = driven_port(DRIVER)
    pool = port.build(SCOPES[1].config, 2)
    with pytest.raises(ValueError, match="not a live handle") as raised:
        pool.free(["not a block"])
    assert type(raised.value).__name__ == "InvalidFreeError"


@pytest.mark.usefixtures("in_tests")
def test_a_failed_invariant_check_comes_back_as_its_class() -> None:
    # Once the client knew no InvariantViolationError and raised a RuntimeError for it.
    port = driven_port([*PLANTED, "planted_bugs:InvariantsAlwaysViolated"])
    pool: Any = port.build(SCOPES[1].config, 2)  # a proxy: it forwards check_invariants too
    with pytest.raises(AssertionError, match="partition: planted") as raised:
        pool.check_invariants()
    assert type(raised.value).__name__ == "InvariantViolationError"


def hello_saying_calls(calls: str | None) -> str:
    """The hello with ``calls`` as the raw JSON text of its calls (``None``: no calls key)."""
    if calls is None:
        return json.dumps({"protocol": PROTOCOL, "version": PROTOCOL_VERSION})
    head = json.dumps({"protocol": PROTOCOL, "version": PROTOCOL_VERSION})[:-1]
    return f'{head}, "calls": {calls}}}'


@pytest.mark.parametrize(
    ("calls", "said"),
    [
        # Once a traceback and status 1: the Port refused the name with a ValueError.
        (json.dumps([*sorted(ALL_CALLS), "teleport"]), "must be names of the operation table"),
        # Once checked on those calls alone, and OK.
        ('["allocate", "free"]', "missing ['blocks_for', 'free_all'"),
        ("[]", "missing ['allocate', 'blocks_for'"),
    ],
    ids=["unknown-call", "too-few", "none"],
)
def test_a_driver_offering_other_calls_than_the_kit_needs_is_refused(calls: str, said: str) -> None:
    script = f"print({hello_saying_calls(calls)!r}, flush=True); input()"
    with pytest.raises(DriverFailure, match=re.escape(said)):
        driven_port(_fake(script))


def _fake(script: str) -> list[str]:
    return [sys.executable, "-c", script]


@pytest.mark.parametrize(
    ("script", "timeout", "said"),
    [
        # It reads the request before it exits: exiting first would race the request's
        # write (a broken pipe, "it stopped reading") against the read of the response.
        (f"print({HELLO!r}, flush=True); input()", 10, "exited \\(status 0\\) before the response"),
        (f"print({HELLO!r}, flush=True); input(); print('oops', flush=True)", 10, "not a JSON"),
        (f"import time; print({HELLO!r}, flush=True); time.sleep(30)", 0.5, "no answer within 0.5"),
        # A byte every 0.1 s and never an end of line: once each byte restarted the clock.
        (
            f"import sys, time; print({HELLO!r}, flush=True); input()\n"
            "for _ in range(300): sys.stdout.write(' '); sys.stdout.flush(); time.sleep(0.1)",
            1,
            "no answer within 1 s",
        ),
        (
            f"import sys; print({HELLO!r}, flush=True); input()\n"
            "sys.stdout.write('x' * (17 << 20)); sys.stdout.flush(); input()",
            10,
            "over 16,777,216 bytes with no end of line",
        ),
        ("print('{}', flush=True)", 10, "its hello is {}"),
        (
            f"print({hello_saying_calls('5')!r}, flush=True)",
            10,
            "expected its calls as a list of names",
        ),
        # Once a hello without calls stood for no calls.
        (f"print({hello_saying_calls(None)!r}, flush=True)", 10, "expected its calls as a list"),
        # Its stdout closed, it went on reading stdin: once waited for with no end.
        (
            f"import os, time; print({HELLO!r}, flush=True); input(); os.close(1); time.sleep(30)",
            0.5,
            "it closed its stdout but did not exit within 0.5 s",
        ),
    ],
    ids=[
        "dies",
        "junk",
        "late",
        "trickles",
        "endless-line",
        "no-hello",
        "calls-not-a-list",
        "no-calls",
        "closes-stdout",
    ],
)
def test_a_broken_driver_is_one_clear_failure(script: str, timeout: float, said: str) -> None:
    with pytest.raises(DriverFailure, match=said):
        DriverProcess(_fake(script), timeout=timeout).request("pool", config={})


def _answering(response: str) -> str:
    """A fake driver that says hello, then answers every request with ``response``
    (``ID`` stands for the request's id)."""
    return (
        f"import json, sys\nprint({HELLO!r}, flush=True)\n"
        "for line in sys.stdin:\n"
        f"    print({response!r}.replace('ID', str(json.loads(line)['id'])), flush=True)\n"
    )


#: A fake driver that refuses every pool request with the config it got, as JSON.
ECHOES_CONFIG = (
    f"import json, sys\nprint({HELLO!r}, flush=True)\n"
    "for line in sys.stdin:\n"
    "    request = json.loads(line)\n"
    "    error = {'class': 'ValueError', 'message': json.dumps(request['config'])}\n"
    "    print(json.dumps({'id': request['id'], 'error': error}), flush=True)\n"
)


def test_every_pool_request_carries_all_five_config_fields() -> None:
    # The kit's config checks call the factory with the fields they set (make(),
    # make(n_blocks=0)); once the driver got just those, though the protocol says five.
    port = driven_port(_fake(ECHOES_CONFIG))
    for fields in ({}, {"n_blocks": 0}, {"block_size": 0, "separate_kv": False}):
        with pytest.raises(ValueError) as refused:
            port.factory(**fields)
        expected = {**dataclasses.asdict(PoolConfig()), **fields}
        assert json.loads(str(refused.value)) == expected


@pytest.mark.parametrize(
    ("response", "said"),
    [
        ('{"id": ID, "result": 5}', "it answered 5 to a pool request; expected a ref"),
        ('{"id": ID, "result": {"ref": "abc"}}', "a ref must be an int"),
        ('{"id": ID, "error": "oops"}', 'expected an error {"class": NAME, "message": TEXT}'),
        ('{"id": ID, "result": 1, "error": {"class": "X"}}', "expected result or error"),
        ('{"id": ID}', "expected result or error"),
        # The pool request is request 1, and true == 1 in Python.
        ('{"id": true, "result": {"ref": 1}}', "it answered {'id': True, "),
        # JSON has no NaN, no infinity; once each was taken as the pool's result.
        ('{"id": ID, "result": NaN}', "not a JSON object (NaN is not a JSON value)"),
        ('{"id": ID, "result": -Infinity}', "(-Infinity is not a JSON value)"),
        ('{"id": ID, "result": 1e400}', "(a number must be finite, got 1e400)"),
    ],
    ids=[
        "not-a-ref",
        "ref-not-an-int",
        "error-not-an-object",
        "both",
        "neither",
        "id-true",
        "nan",
        "infinity",
        "past-a-float",
    ],
)
def test_a_driver_answer_that_breaks_the_protocol_is_one_clear_failure(
    response: str, said: str
) -> None:
    port = driven_port(_fake(_answering(response)))
    with pytest.raises(DriverFailure, match=re.escape(said)):
        port.build(SCOPES[1].config, 2)


@pytest.mark.parametrize(
    ("response", "said"),
    [
        (
            '{"id": ID, "error": {"class": "ValueError", "message": "unknown ref"}}',
            "it answered ValueError (unknown ref) to the drop of ref 7",
        ),
        ('{"id": ID, "result": 5}', "it answered 5 to the drop of ref 7; expected null"),
    ],
    ids=["an error", "a value"],
)
def test_an_answer_to_a_drop_other_than_null_is_a_protocol_error(response: str, said: str) -> None:
    # Once an error answered to a drop was raised as the next request's outcome: a report
    # blamed the port's config checks for it.
    driver = DriverProcess(_fake(_answering(response)))
    driver.dropped.append(7)
    with pytest.raises(DriverFailure, match=re.escape(said)):
        driver.request("pool", config={})


def test_a_class_name_outside_the_contract_is_named_in_what_is_raised() -> None:
    error = '{"class": "InvalidFree", "message": "blocks[1] is not live"}'
    driver = DriverProcess(_fake(_answering(f'{{"id": ID, "error": {error}}}')))
    with pytest.raises(RuntimeError, match=r"^'InvalidFree', not a class of the contract: blocks"):
        driver.request("pool", config={})


def test_a_name_the_driver_s_object_lacks_reads_as_missing() -> None:
    # An AttributeError answer is what the kit's name checks (hasattr) read as a name
    # missing; once it came back as a RuntimeError and the report lost the name.
    error = '{"class": "AttributeError", "message": "no n_retired"}'
    driver = DriverProcess(_fake(_answering(f'{{"id": ID, "error": {error}}}')))
    assert not hasattr(DrivenObjects(driver).proxy(1), "n_retired")


def test_a_method_is_asked_for_once_per_object_then_only_called() -> None:
    port = driven_port(DRIVER)
    pool = port.factory()
    driver = pool._objects.driver
    sent: list[tuple[str, object]] = []
    request = driver.request

    def recording(op: str, **fields: object) -> object:
        sent.append((op, fields.get("name")))
        return request(op, **fields)

    driver.request = recording
    assert [pool.n_free("k") for _ in range(3)] == [pool.n_free("k")] * 3
    assert sent.count(("get", "n_free")) == 1
    assert sent.count(("call", "n_free")) == 4


@pytest.mark.parametrize(
    ("request_line", "said"),
    [
        (
            b"{oops",
            "request line 2 is not JSON "
            "(Expecting property name enclosed in double quotes): '{oops'",
        ),
        (b"[1]", "request line 2 must be a JSON object, got list: '[1]'"),
        (b"\xff{}", "request line 2 is not UTF-8 text (invalid start byte): b'\\xff{}'"),
        (b"[" * 200_000, "request line 2 is nested too deeply to read"),
        (b'{"id": ' + b"9" * 5000 + b"}", "request line 2 cannot be read (Exceeds the limit"),
        # Once a KeyError answered as the port's error, and __init__ re-made the pool.
        (b'{"id": 2, "op": "nosuch"}', "request line 2 has op 'nosuch'; expected one of pool,"),
        (
            b'{"id": 2, "op": "get", "on": "1", "name": "stats"}',
            "request line 2 (get) has on '1'; expected a JSON int",
        ),
        (
            b'{"id": 2, "op": "call", "on": 1, "name": "__init__", "args": []}',
            "request line 2 (call) names '__init__'",
        ),
        (
            b'{"id": 2, "op": "get", "on": 1, "name": "_lock"}',
            "request line 2 (get) names '_lock'; expected",
        ),
        (
            b'{"id": 2, "op": "get", "on": 99, "name": "stats"}',
            "request line 2 (get) names ref(s) [99], which",
        ),
        (
            b'{"id": 2, "op": "call", "on": 1, "name": "free", "args": [[{"ref": 7}]]}',
            "request line 2 (call) names ref(s) [7], which this driver never handed out",
        ),
        (
            b'{"id": 2, "op": "pool", "config": {}, "history_len": "x"}',
            "request line 2 (pool) has history_len 'x'; expected a JSON int or null",
        ),
        (b'{"op": "get", "on": 1, "name": "stats"}', "request line 2 has id None; expected a"),
        (b'{"id": true, "op": "get", "on": 1, "name": "stats"}', "request line 2 has id True;"),
        (
            b'{"id": 2, "op": "call", "on": 1, "name": "allocate", "args": ["k", NaN, 7]}',
            "request line 2 cannot be read (NaN is not a JSON value)",
        ),
        (
            b'{"id": 2, "op": "call", "on": 1, "name": "allocate", "args": ["k", 1e400, 7]}',
            "request line 2 cannot be read (a number must be finite, got 1e400)",
        ),
    ],
    ids=[
        "not-json",
        "not-an-object",
        "not-utf-8",
        "nested-200000-deep",
        "int-of-5000-digits",
        "unknown-op",
        "ref-not-an-int",
        "special-method",
        "private-name",
        "unknown-ref",
        "unknown-ref-in-args",
        "history-len-not-an-int",
        "no-id",
        "id-true",
        "nan",
        "float-past-its-range",
    ],
)
def test_the_driver_refuses_a_request_line_the_protocol_has_no_answer_for(
    request_line: bytes, said: str
) -> None:
    pool = json.dumps({"id": 1, "op": "pool", "config": dataclasses.asdict(SEPARATE_4.config)})
    # Bytes, and one good line after the bad one: the lines before the bad one are
    # answered whatever follows (stdin is read line by line, not decoded in chunks).
    given = pool.encode() + b"\n" + request_line + b"\n" + pool.encode() + b"\n"
    ran = subprocess.run(DRIVER, input=given, capture_output=True, check=False)
    assert ran.returncode == 2
    hello, answer = ran.stdout.decode().splitlines()
    assert json.loads(hello)["protocol"] == PROTOCOL
    assert json.loads(answer) == {"id": 1, "result": {"ref": 1}}
    [error] = ran.stderr.decode().splitlines()
    assert error.startswith(f"python -m veloxquant_mlx.testing.driver: error: {said}")


@pytest.fixture
def in_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from tests/, so that a driver (started here) imports ``planted_bugs``."""
    monkeypatch.chdir(Path(__file__).parent)


def _exhaustive(*driver: str) -> int:
    return cli.main(
        ["exhaustive", "--driver", shlex.join(driver), "--depth", "2", "--scope", SEPARATE_4.name]
    )


@pytest.mark.usefixtures("in_tests")
def test_the_exhaustive_command_finds_a_planted_deviation_through_a_driver(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _exhaustive(*PLANTED, "planted_bugs:FreeCountsBlocks") == 1
    out = capsys.readouterr().out
    assert "separate-4: depth 2," in out and "COUNTEREXAMPLE" in out
    assert "\n2 operations:\n  0: Allocate(stream='k', n_tokens=3, owner=0" in out
    assert "(stats.n_frees is 2; the spec predicts 1)" in out


@pytest.mark.usefixtures("in_tests")
def test_an_error_class_of_the_ports_own_is_a_deviation_through_a_driver_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Once the driver named a TypeError subclass "TypeError", and the port passed there
    # while the in-process route (which names its own class) found the deviation.
    in_process = ["exhaustive", "--depth", "1", "--scope", SEPARATE_4.name, "--factory"]
    assert cli.main([*in_process, "planted_bugs:AllocateRaisesItsOwnTypeError"]) == 1
    assert "OwnTypeError" in capsys.readouterr().out
    driven = [*PLANTED, "planted_bugs:AllocateRaisesItsOwnTypeError"]
    assert cli.main(["exhaustive", "--driver", shlex.join(driven), *in_process[1:-1]]) == 1
    assert "COUNTEREXAMPLE" in capsys.readouterr().out


def counterexample_found_on(
    port: str, depth: int, out: Path, capsys: pytest.CaptureFixture[str]
) -> str:
    """The trace file of the counterexample ``exhaustive`` must find on ``port``."""
    scope = ["--depth", str(depth), "--scope", SEPARATE_4.name]
    assert cli.main(["exhaustive", "--factory", port, *scope, "--out", str(out)]) == 1
    capsys.readouterr()
    return str(next(out.glob("counterexample-*.jsonl")))


def replay_fails_on(port: str, trace: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``replay`` of ``trace`` fails on ``port``, in process and through its driver."""
    for how in (["--factory", port], ["--driver", shlex.join([*PLANTED, port])]):
        assert cli.main(["replay", trace, *how]) == 1
        assert said in capsys.readouterr().err


@pytest.mark.usefixtures("in_tests")
@pytest.mark.parametrize(
    ("planted", "depth", "said"),
    [
        ("planted_bugs:FreeCountsBlocks", 2, "(stats.n_frees is 2; the spec predicts 1)"),
        # Its trace holds no call: the replay once ran nothing and said "0 ops: ok".
        ("planted_bugs:NFreeCountsOneMore", 1, "FAILED: a fresh pool, before line 1:"),
    ],
)
def test_a_counterexample_found_on_a_port_fails_its_replay_on_that_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str, depth: int, said: str
) -> None:
    # Once a counterexample replayed "ok" everywhere: replay could not run a port.
    trace = counterexample_found_on(planted, depth, tmp_path, capsys)
    replay_fails_on(planted, trace, said, capsys)


@pytest.mark.usefixtures("in_tests")
def test_a_port_counterexample_replays_ok_on_our_pool_and_refuses_what_cannot_run_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    planted = "planted_bugs:FreeCountsBlocks"
    trace = counterexample_found_on(planted, 2, tmp_path, capsys)
    assert cli.main(["replay", trace, "--on", "pool"]) == 0  # our pool agrees with the spec
    assert cli.main(["replay", trace, "--factory", planted, "--on", "mlx"]) == 2
    assert "--factory replays on that port beside the spec" in capsys.readouterr().err
    assert cli.main(["replay", trace, "--factory", "json:loads"]) == 2  # builds no pool
    assert "the port 'loads' raised" in capsys.readouterr().err


@pytest.mark.usefixtures("in_tests")
def test_a_fresh_pool_counterexample_passes_a_sound_fresh_pool_and_fails_a_non_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = counterexample_found_on("planted_bugs:NFreeCountsOneMore", 1, tmp_path, capsys)
    assert cli.main(["replay", trace, "--factory", "planted_bugs:FreeCountsBlocks"]) == 0
    capsys.readouterr()
    # A "pool" with no API at all: once a traceback mid-replay, now one failure line.
    assert cli.main(["replay", trace, "--factory", "planted_bugs:not_a_pool"]) == 1
    failed = capsys.readouterr().err
    assert "FAILED: a fresh pool, before line 1:" in failed
    assert "Traceback" not in failed


def test_the_exhaustive_command_passes_our_pool_through_its_driver(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _exhaustive(*DRIVER) == 0
    assert "separate-4: depth 2," in capsys.readouterr().out


def test_a_driver_that_dies_mid_run_ends_the_command_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "crashing.py").write_text(
        "import os, sys\n"
        "from veloxquant_mlx.memory.block_pool import BlockPoolAllocator\n"
        "class Crashing(BlockPoolAllocator):\n"
        "    def shrink(self, stream, target_free):\n"
        "        print('shrink crashed', file=sys.stderr, flush=True)\n"
        "        os._exit(3)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert _exhaustive(*DRIVER, "--factory", "crashing:Crashing") == 2
    [line] = capsys.readouterr().err.splitlines()[-1:]
    assert "veloxquant-mlx exhaustive: error: driver " in line
    assert "it exited (status 3) before the response to" in line
    # The calls that crashed it, as the exhaustive checker's letters:
    assert line.endswith(
        "its stderr ends: shrink crashed (exploring separate-4; "
        "the failing run on a new pool: shrink('k', 0))"
    )


@pytest.mark.slow(seconds=11)
@pytest.mark.usefixtures("in_tests")
def test_a_driver_that_dies_deep_in_a_run_is_told_the_calls_that_led_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "crashing_late.py").write_text(
        "import os\n"
        "from veloxquant_mlx.memory.block_pool import BlockPoolAllocator\n"
        "class CrashingOnASecondFree(BlockPoolAllocator):\n"
        "    def free(self, blocks):\n"
        "        if self.stats.n_frees == 1:\n"
        "            os._exit(3)\n"
        "        super().free(blocks)\n"
    )
    monkeypatch.chdir(tmp_path)
    port = driven_port([*DRIVER, "--factory", "crashing_late:CrashingOnASecondFree"])
    with pytest.raises(DriverFailure) as raised:
        explore(SEPARATE_4, 3, port)
    [note] = raised.value.__notes__
    # Every call the crashed pool saw, in order: the path to the state, then the no-ops
    # run there in one go, the last of them the second free.
    assert note.startswith("the failing run on a new pool: allocate("), note
    assert ", then the no-ops " in note and note.endswith(", free([freed last])"), note
    assert note.count("free(") == 2, note


@pytest.mark.slow
@pytest.mark.usefixtures("in_tests")
def test_the_kit_finds_a_planted_deviation_through_a_driver_and_allows_it() -> None:
    port = driven_port([*PLANTED, "planted_bugs:FreeCountsBlocks"])
    report_on = functools.partial(
        conformance_report, port, depth=2, scopes=[SEPARATE_4], examples=0
    )
    report = report_on()
    assert [(f.rule, f.call, f.field, len(f.calls)) for f in report.findings] == [
        ("C-COUNTERS-NFREES", "free", "stats.n_frees", 2)
    ]
    assert "    pool.free([b0[1], b0[0]])" in report.render()
    allowed = report_on(allow={"C-COUNTERS-NFREES": "planted"})
    assert allowed.conforms, allowed.render()
    assert [(f.rule, why) for f, why in allowed.expected] == [("C-COUNTERS-NFREES", "planted")]
    # Its stats field is masked (testing.masking), so sequences went on past it: once
    # they ended there, and the summary said "not followed past C-COUNTERS-NFREES".
    assert allowed.unfollowed == []
    assert ": conforms: " in allowed.render()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_conformance(
            port,
            allow={"C-COUNTERS-NFREES": "planted"},
            depth=2,
            scopes=[SEPARATE_4],
            examples=0,
        )
