"""The conformance kit as a backend author adopts it (docs/CONFORMANCE_KIT.md).

A port of the reference API (``tests/reference_port.py``: ``MyPool(config)``,
its own ``PoolConfig``, ``Block`` and error classes) passes with the README's
recipe; the factory contract is forgiving; a deliberately deviant port
(``tests/deviant_port.py``) gets every planted deviation listed once, under
its contract rule, in one run, and passes with them allowed.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, NoReturn

import pytest
import reference_port
from deviant_port import DEVIANT_ERRORS, DEVIATIONS, DeviantConfig, DeviantPort
from reference_port import MyPool

from veloxquant_mlx.memory import block_pool
from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
)
from veloxquant_mlx.testing import exhaustive
from veloxquant_mlx.testing import report as report_module
from veloxquant_mlx.testing.conformance import conformance_test_case
from veloxquant_mlx.testing.differences import Discrepancy
from veloxquant_mlx.testing.findings import Finding, rule_of
from veloxquant_mlx.testing.lockstep import ConformanceError, Lockstep
from veloxquant_mlx.testing.port import ALL_CALLS, REFERENCE_CALLS, Port, as_port
from veloxquant_mlx.testing.profiles import PROFILE_VARIABLE
from veloxquant_mlx.testing.python_text import as_python
from veloxquant_mlx.testing.report import conformance_report
from veloxquant_mlx.testing.surface import check_config_validation, check_names
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import Allocate, Stats
from veloxquant_mlx_spec.table import UNKNOWN_CALL, Handle, Raised, Returned, h

# The README's recipe, unchanged, on a port of the reference API.
TestMyPoolConforms = pytest.mark.slow(seconds=16)(conformance_test_case(MyPool))


# ---- the factory contract ---------------------------------------------------------------


def test_a_reference_port_offers_the_reference_calls_only() -> None:
    assert as_port(MyPool).capabilities == REFERENCE_CALLS
    assert as_port(BlockPoolAllocator).capabilities == ALL_CALLS


def test_the_factory_gets_the_ports_own_config_class() -> None:
    pool = Port(MyPool, config_class=reference_port.PoolConfig).build(PoolConfig(4, 8))
    assert type(pool.config) is reference_port.PoolConfig
    assert (pool.config.block_size, pool.config.n_blocks) == (4, 8)


def test_a_factory_without_config_class_gets_plain_values() -> None:
    seen: dict[str, object] = {}

    def make_pool(history_len: int = 1024, **fields: Any) -> MyPool:
        seen.update(fields, history_len=history_len)
        return MyPool(reference_port.PoolConfig(**fields))

    Port(make_pool, config_class=None).build(PoolConfig(4, 8), 3)
    assert seen == {
        "block_size": 4,
        "n_blocks": 8,
        "separate_kv": True,
        "grow_on_exhaustion": False,
        "max_blocks": None,
        "history_len": 3,
    }


def test_history_len_reaches_a_factory_that_takes_it() -> None:
    port = Port(BlockPoolAllocator)
    assert port.takes_history_len
    assert port.build(PoolConfig(2, 2), 3).history.maxlen == 3  # type: ignore[attr-defined]


def test_a_factory_without_history_len_is_checked_at_the_default_only() -> None:
    port = Port(MyPool)
    assert not port.takes_history_len
    assert port.history_lens == (1024,)
    with pytest.raises(ValueError, match="MyPool takes no history_len"):
        port.build(PoolConfig(2, 2), 3)


def test_the_ports_block_class_builds_the_hand_made_blocks() -> None:
    lockstep = Lockstep(Port(MyPool, block_class=reference_port.Block), model.SpecConfig(2, 4))
    hand_made = lockstep.pool_side.resolve(model.ForeignBlock(None))
    assert type(hand_made) is reference_port.Block


def test_the_ports_error_classes_compare_under_the_contracts_names() -> None:
    lockstep = Lockstep(Port(MyPool), model.SpecConfig(2, 1))
    lockstep.apply(Allocate("k", 2, 0))
    # The port raises its own class, named as the contract's.
    assert lockstep.apply(Allocate("k", 2, 0)) == Raised("BlockPoolExhaustedError")


def test_an_unknown_capability_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'defragment'"):
        Port(MyPool, capabilities=frozenset({"allocate", "defragment"}))


def test_a_port_offering_fewer_calls_than_the_reference_and_the_contract_is_refused() -> None:
    # Once checked on the calls it named alone: a port without free passed exhaustive.
    with pytest.raises(ValueError, match=r"missing \['free'\]"):
        Port(MyPool, capabilities=REFERENCE_CALLS - {"free"})


class _StatsRaise(BlockPoolAllocator):
    """A port whose ``stats`` raises: a deviation for the checks to find."""

    @property
    def stats(self) -> Any:
        raise RuntimeError("no stats here")


def test_finding_the_calls_of_a_port_whose_stats_raise_does_not_crash() -> None:
    # Looking at which calls it offers read its stats: a traceback before any check.
    assert as_port(_StatsRaise).offered == REFERENCE_CALLS


def test_a_config_class_that_refuses_an_empty_pool_is_a_finding() -> None:
    class NoEmptyPools(reference_port.PoolConfig):
        def __init__(self, *args: Any, **fields: Any) -> None:
            super().__init__(*args, **fields)
            if self.n_blocks == 0:
                raise ValueError("n_blocks must be >= 1")

    findings = check_config_validation(Port(MyPool, config_class=NoEmptyPools))
    assert [(f.rule, f.field) for f in findings] == [
        ("C-CONFIG-EMPTY", "n_blocks=0"),
        ("C-CONFIG-EMPTY", "n_blocks=0, grow_on_exhaustion=True"),
    ]


# ---- no private field, no bare AttributeError ------------------------------------------


class _StatsWithoutGrowth:
    """A stats object without ``n_grown`` (and without anything private)."""

    def __init__(self, stats: object) -> None:
        self._stats = stats

    def __getattr__(self, name: str) -> object:
        if name == "n_grown":
            raise AttributeError(name)
        return getattr(self._stats, name)


class _NoGrowthCounter(MyPool):
    @property
    def stats(self) -> Any:
        return _StatsWithoutGrowth(self.books.stats)


def test_a_missing_stats_field_is_a_named_difference() -> None:
    lockstep = Lockstep(Port(_NoGrowthCounter), model.SpecConfig(2, 4))
    with pytest.raises(ConformanceError) as raised:
        lockstep.apply(Stats())
    assert "<no attribute stats.n_grown>" in str(raised.value)
    assert check_names(Port(_NoGrowthCounter))[0].key == ("C-NAMES", "stats", "n_grown")


def test_the_kit_reads_nothing_private_of_a_stats_object() -> None:
    assert check_names(Port(MyPool)) == []
    lockstep = Lockstep(Port(MyPool), model.SpecConfig(2, 4))
    lockstep.apply(Allocate("k", 3, 0))  # stats, history and every handle compared


# ---- Hypothesis profiles in a port's own test file -------------------------------------


@pytest.mark.parametrize(("profile", "examples"), [("nightly", 5_000), ("mutation", 200)])
def test_the_profile_variable_reaches_a_ports_test_case(
    monkeypatch: pytest.MonkeyPatch, profile: str, examples: int
) -> None:
    monkeypatch.setenv(PROFILE_VARIABLE, profile)
    test_case: Any = conformance_test_case(MyPool)
    assert test_case.settings.max_examples == examples


# ---- every deviation in one run --------------------------------------------------------


def _python_of(finding: Finding) -> list[str]:
    config = finding.config or model.SpecConfig()
    port = Port(DeviantPort, config_class=DeviantConfig, errors=DEVIANT_ERRORS)
    return as_python(port, finding.calls, config, finding.history_len, finding.discrepancy)


def _run_to_the_read(lines: list[str], scope: Mapping[str, object]) -> object:
    """Run a finding's Python in ``scope`` (``suppress`` added); the value its last line
    reads."""
    *setup, last = lines
    names = {**scope, "suppress": suppress}
    exec("\n".join(setup), names)
    return eval(last.split("  #")[0], names)


def _runs_and_shows_the_pools_value(finding: Finding) -> None:
    scope = {
        "DeviantPort": DeviantPort,
        "DeviantConfig": DeviantConfig,
        "Block": reference_port.Block,
    }
    assert _run_to_the_read(_python_of(finding), scope) == finding.actual


@pytest.mark.slow(seconds=37)
def test_one_run_lists_each_planted_deviation_once_readably() -> None:
    # One test, not three: the run is the expensive part, and xdist would repeat a fixture.
    report = conformance_report(
        DeviantPort, config_class=DeviantConfig, errors=DEVIANT_ERRORS, time_budget=300
    )  # about 30 s here; the budget is a cap, so a loaded machine cannot cut a part short
    print(report.render())  # the figures: total seconds and the longest shrink
    assert sorted(f.rule for f in report.findings) == sorted(DEVIATIONS)
    assert all(len(f.calls) <= 5 for f in report.findings)
    assert not report.gaps  # every part ran to its end within the time budget

    text = report.render()
    assert all(len(block.splitlines()) <= 20 for block in text.split("\n\n")[1:])
    assert "docs/CONTRACT.md#c-counters-nfrees" in text
    assert "Lockstep" not in text and "ForeignBlock" not in text and "h(" not in text

    after_a_call = [
        f
        for f in report.findings
        if f.calls and f.discrepancy is not None and f.discrepancy.kind == "observation"
    ]
    assert after_a_call, "the deviant port has a deviation seen after a call"
    for finding in after_a_call:
        _runs_and_shows_the_pools_value(finding)


@pytest.mark.slow(seconds=24)
def test_the_deviant_port_passes_with_its_deviations_allowed() -> None:
    allow = {rule: "planted on purpose" for rule in DEVIATIONS}
    report = conformance_report(
        DeviantPort,
        config_class=DeviantConfig,
        errors=DEVIANT_ERRORS,
        allow=allow,
        examples=100,
        time_budget=300,
    )
    assert report.conforms, report.render()
    assert sorted(f.rule for f, _ in report.expected) == sorted(DEVIATIONS)
    # Outcome deviations end their sequences (what follows is not checked), and the report
    # says so; the observations of the others are masked, so sequences go on past them.
    assert report.unfollowed == ["C-INT-NOT-BOOL", "C-MARK-USED-FREE"]
    assert ": conforms (not followed past C-INT-NOT-BOOL, C-MARK-USED-FREE): " in report.render()


SEPARATE_4 = next(scope for scope in exhaustive.SCOPES if scope.name == "separate-4")


class _CountsFreesTwiceAndNoReuse(BlockPoolAllocator):
    """Two deviations: every free and free_all counts two in ``n_frees``, and ``n_reused``
    stays 0. A reused id needs a free first, so the second shows only past the first."""

    def free(self, blocks: list[Block]) -> None:
        super().free(blocks)
        with self._lock:
            self._stats.n_frees += 1

    def free_all(self, owner: int) -> None:
        super().free_all(owner)
        with self._lock:
            self._stats.n_frees += 1

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        blocks = super().allocate(stream, n_tokens, owner, format)
        with self._lock:
            self._stats.n_reused = 0
        return blocks


def test_sequences_go_on_past_an_allowed_difference_of_observations() -> None:
    """Before masking, a sequence ended at any deviation, allowed or not: with
    C-COUNTERS-NFREES allowed, the kit passed this port, never reaching a reused id."""
    report_on = functools.partial(
        conformance_report,
        _CountsFreesTwiceAndNoReuse,
        depth=3,
        scopes=[SEPARATE_4],
        examples=0,
        errors=block_pool,
    )
    unmasked = report_on()
    assert {f.rule for f in unmasked.findings} == {"C-COUNTERS-NFREES"}
    masked = report_on(allow={"C-COUNTERS-NFREES": "we count frees our way"})
    assert [(f.rule, f.call, f.field) for f in masked.findings] == [
        ("C-COUNTERS-ALLOC", "allocate", "stats.n_reused")
    ]
    assert [f.rule for f, _ in masked.expected] == ["C-COUNTERS-NFREES"]
    assert masked.unfollowed == []


class _KeepsNoHistory(BlockPoolAllocator):
    """``history`` raises (C-HISTORY); nothing else deviates."""

    @property
    def history(self) -> NoReturn:
        raise NotImplementedError("this port keeps no history")


class _UnreadableHistory(deque[AllocationStats]):
    """A history whose snapshots cannot be read: iterating it raises."""

    def __iter__(self) -> NoReturn:
        raise RuntimeError("the history is kept elsewhere")


class _HistoryCannotBeRead(BlockPoolAllocator):
    """``history`` returns a value the kit cannot read (C-HISTORY); nothing else deviates."""

    @property
    def history(self) -> deque[AllocationStats]:
        return _UnreadableHistory()


def test_a_value_the_kit_cannot_read_is_a_finding_not_a_gap() -> None:
    # Once the kit's own reading of the value raised outside the call: the parts became
    # gaps, and the verdict "inconclusive".
    report = conformance_report(
        _HistoryCannotBeRead, depth=2, scopes=[SEPARATE_4], examples=0, errors=block_pool
    )
    assert report.gaps == []
    assert {f.rule for f in report.findings} == {"C-HISTORY"}
    assert "returned a value the kit cannot read (RuntimeError: the history is kept" in (
        report.render(verbose=True)
    )


class _CountsOneBlockMore(BlockPoolAllocator):
    """``stats.n_blocks`` one more (C-STATS-NBLOCKS); its fragmentation, fragmented blocks
    over its own ``n_blocks``, is consistent with that."""

    @property
    def stats(self) -> AllocationStats:
        stats = super().stats
        stats.n_blocks += 1
        return stats


class _CountsOneBlockMoreAndNoFragmentation(_CountsOneBlockMore):
    """As ``_CountsOneBlockMore``, and its fragmentation is always 0.0: a fault of its own
    (C-STATS-FRAGMENTATION), not the echo of ``n_blocks``."""

    @property
    def stats(self) -> AllocationStats:
        stats = super().stats
        stats._fragmented_count = 0
        return stats


def test_a_masked_n_blocks_hides_no_fragmentation_fault_of_its_own() -> None:
    # Once masking n_blocks masked fragmentation whole, and this port conformed.
    report = conformance_report(
        _CountsOneBlockMoreAndNoFragmentation,
        allow={"C-STATS-NBLOCKS": "ours"},
        depth=2,
        scopes=[SEPARATE_4],
        examples=0,
        errors=block_pool,
    )
    assert {(f.rule, f.field) for f in report.findings} == {
        ("C-STATS-FRAGMENTATION", "stats.fragmentation")
    }


class _CountsSharesTwice(BlockPoolAllocator):
    """``stats.n_shares`` counts each shared handle twice (C-COUNTERS-SHARE)."""

    def share(self, blocks: list[Block], owner: int) -> list[Block]:
        shared = super().share(blocks, owner)
        with self._lock:
            self._stats._n_shares += len(shared)
        return shared


def test_a_sharing_counter_that_differs_is_filed_under_the_rule_that_counts_it() -> None:
    # Once filed under the last call's rule (C-SHARE), so allowing C-COUNTERS-SHARE
    # matched nothing.
    report = conformance_report(
        _CountsSharesTwice, depth=2, scopes=[SEPARATE_4], examples=0, errors=block_pool
    )
    assert [(f.rule, f.field) for f in report.findings] == [("C-COUNTERS-SHARE", "n_shares")]


@pytest.mark.parametrize(
    ("port", "rule"),
    [
        (_KeepsNoHistory, "C-HISTORY"),
        (_HistoryCannotBeRead, "C-HISTORY"),
        (_CountsOneBlockMore, "C-STATS-NBLOCKS"),
        (_CountsSharesTwice, "C-COUNTERS-SHARE"),
    ],
    ids=[
        "history-raises",
        "history-cannot-be-read",
        "n-blocks-and-its-fragmentation",
        "sharing-counter-and-its-sample",
    ],
)
def test_a_masked_rule_brings_no_false_finding_and_ends_no_sequence(
    port: type[BlockPoolAllocator], rule: str
) -> None:
    # Found by review: a raising history crashed the masked comparison (the exhaustive
    # part became a gap), and so did two checks outside sequences that read it; the
    # fragmentation computed from a masked n_blocks became a C-STATS-FRAGMENTATION
    # finding; and a finding of the bad-arguments check, outside sequences, was counted
    # as ending them ("not followed past").
    report = conformance_report(
        port, allow={rule: "ours"}, depth=2, scopes=[SEPARATE_4], examples=20, errors=block_pool
    )
    assert report.conforms, report.render()  # no finding, no gap
    assert {f.rule for f, _ in report.expected} == {rule}
    assert report.unfollowed == []


def test_an_allow_list_entry_that_matched_nothing_is_said_without_verbose() -> None:
    # Once said only under verbose=True: a typo in a rule id went unseen.
    allow = {"C-CONFIG-TYPE": "a typo", "C-CONFIG-TYPES": "planted"}
    report = conformance_report(
        DeviantPort,
        config_class=DeviantConfig,
        errors=DEVIANT_ERRORS,
        allow=allow,
        scopes=(),
        examples=0,
    )
    assert report.unmatched_allow == ["C-CONFIG-TYPE"]
    text = report.render()
    assert "Allow-list entries that matched no finding" in text
    assert "'C-CONFIG-TYPE'" in text


def test_a_finding_shows_a_shortest_sequence_as_python() -> None:
    port = Port(DeviantPort, config_class=DeviantConfig, errors=DEVIANT_ERRORS)
    lockstep = Lockstep(port, model.SpecConfig(2, 4))
    lockstep.apply(Allocate("k", 3, 0))
    from veloxquant_mlx_spec.operations import Free

    with pytest.raises(ConformanceError) as raised:
        lockstep.apply(Free((h(0, 1), h(0, 0))))
    error = raised.value
    assert error.discrepancy is not None
    text = as_python(
        port, [op for _, op in error.trace], model.SpecConfig(2, 4), 1024, error.discrepancy
    )
    assert text == [
        "pool = DeviantPort(DeviantConfig(block_size=2, n_blocks=4))",
        "b0 = pool.allocate('k', 3, 0)",
        "pool.free([b0[1], b0[0]])",
        "pool.stats.n_frees  # pool: 2; spec: 1",
    ]


def test_the_python_of_a_finding_seen_after_a_refused_call_runs_to_its_last_line() -> None:
    # Once the refused last call was left unwrapped: the paste stopped there, raising.
    port = Port(BlockPoolAllocator, config_class=PoolConfig)
    seen = Discrepancy("observation", Stats(), "n_allocations", 5, 1)
    calls = [Allocate("k", 3, 0), Allocate("k", 100, 0)]
    text = as_python(port, calls, model.SpecConfig(2, 4), 1024, seen)
    assert text[-2:] == [
        "with suppress(BlockPoolExhaustedError): pool.allocate('k', 100, 0)",
        "pool.stats.n_allocations  # pool: 5; spec: 1",
    ]
    scope: dict[str, object] = {
        "BlockPoolAllocator": BlockPoolAllocator,
        "PoolConfig": PoolConfig,
        "BlockPoolExhaustedError": BlockPoolExhaustedError,
    }
    assert _run_to_the_read(text, scope) == 1


@pytest.mark.parametrize(
    ("grows", "rule"), [(False, "C-ALL-OR-NOTHING"), (True, "C-GROW-EXACT")], ids=["off", "on"]
)
def test_an_allocation_refused_that_could_be_met_is_filed_under_the_rule_it_breaks(
    grows: bool, rule: str
) -> None:
    # Once it was C-GROW-EXACT even in a pool that never grows.
    refused = Discrepancy(
        "outcome", Allocate("k", 4, 0), "", Raised("BlockPoolExhaustedError"), Returned((0, 1))
    )
    config = model.SpecConfig(2, 4, grow_on_exhaustion=grows)
    assert rule_of(refused, refused.where, config)[0] == rule


def test_a_handle_no_call_returned_is_said_so_in_findings() -> None:
    # Once shown as "h(-1, 3)", a name no trace or report explains.
    assert repr(Handle(UNKNOWN_CALL, 3)) == "<a handle no call returned, #3>"
    assert repr(h(2, 1)) == "h(2, 1)"


# ---- the exhaustive checker on a port ---------------------------------------------------


def test_the_exhaustive_command_checks_a_factory_named_on_its_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).parent)
    found = exhaustive.main(
        ["--factory", "deviant_port:DeviantPort", "--depth", "1", "--scope", "separate-4"]
    )
    assert found == 1
    assert "MarkUsed(block=ForeignBlock(owner=None), n_used=1)" in capsys.readouterr().out
    passed = exhaustive.main(["--factory", "reference_port:MyPool", "--depth", "2"])
    assert passed == 0


def test_the_exhaustive_command_takes_a_port_object_naming_the_ports_own_classes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Once a Port was refused ("is not callable"): a port whose classes the factory's
    # module does not hold could not say which they are on the command line.
    (tmp_path / "my_port.py").write_text(
        "from reference_port import Block, MyPool, PoolConfig\n"
        "from veloxquant_mlx.testing.port import Port\n"
        "PORT = Port(MyPool, config_class=PoolConfig, block_class=Block)\n"
        "NUMBER = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    scope = ["--depth", "1", "--scope", "separate-4"]
    assert exhaustive.main(["--factory", "my_port:PORT", *scope]) == 0
    assert "separate-4: depth 1, " in capsys.readouterr().out
    assert exhaustive.main(["--factory", "my_port:NUMBER", *scope]) == 2
    assert "'my_port:NUMBER' is neither a Port nor callable" in capsys.readouterr().err


# ---- a light install -------------------------------------------------------------------


def test_the_kit_imports_without_mlx(tmp_path: Path) -> None:
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        textwrap.dedent(
            """
            import sys

            class _NoMLX:
                def find_spec(self, name, path=None, target=None):
                    if name == "mlx" or name.startswith(("mlx.", "mlx_lm")):
                        raise ImportError(f"{name} is blocked for this test")
                    return None

            sys.meta_path.insert(0, _NoMLX())
            """
        )
    )
    code = (
        "import veloxquant_mlx.testing, veloxquant_mlx.testing.conformance, "
        "veloxquant_mlx.testing.report, veloxquant_mlx.testing.exhaustive, sys; "
        "assert not any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules)"
    )
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}spec{os.pathsep}."}
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


# -- the report never says "conforms" for a part it cut short -------------------------------


def _out_of_time_after(n: int) -> Callable[[object], bool]:
    """``_Collector.out_of_time`` that says no ``n`` times, then yes (a clock that runs out)."""
    left = [n]

    def out_of_time(collector: object) -> bool:
        left[0] -= 1
        return left[0] < 0

    return out_of_time


@pytest.mark.parametrize(
    ("answers_in_time", "gap"),
    [
        (0, "random: none of 1000 sequences run: the time budget ran out"),
        (2, "random: 25 of 1000 sequences run: the time budget ran out"),
    ],
    ids=["before-it-starts", "after-one-run"],
)
def test_random_sequences_the_time_budget_cut_make_the_report_inconclusive(
    monkeypatch: pytest.MonkeyPatch, answers_in_time: int, gap: str
) -> None:
    # Once a cut random part was left out of the gaps, and the verdict said "conforms".
    clock = _out_of_time_after(answers_in_time)
    monkeypatch.setattr(report_module._Collector, "out_of_time", clock)
    report = conformance_report(BlockPoolAllocator, scopes=[], examples=1000)
    assert report.gaps == [gap]
    assert (report.verdict, report.conforms) == ("inconclusive", False)
    assert f"Not checked:\n  {gap}\n\nNot in scope: calls from several threads" in report.render()


def test_an_exhaustive_scope_cut_short_does_not_claim_every_sequence() -> None:
    scope = exhaustive.SCOPES[0]
    report = conformance_report(BlockPoolAllocator, scopes=[scope], examples=0, time_budget=0)
    assert report.verdict == "inconclusive"
    line = next(part for part in report.checked if part.startswith(f"exhaustive {scope.name}"))
    assert "stopped early" in line
    assert "every sequence" not in line


def test_a_report_names_every_rule_it_does_not_check() -> None:
    # It named the thread rules alone: a port whose errors say nothing conformed, with no
    # word that C-ERROR-MESSAGE was never looked at.
    last = conformance_report(BlockPoolAllocator, scopes=[], examples=0).render().splitlines()[-1]
    for rule in ("C-THREAD-SAFE", "C-LINEARIZABLE", "C-ERROR-MESSAGE", "C-GROW-MEMORY"):
        assert rule in last
    assert "C-IMPORT-NO-MLX" in last
