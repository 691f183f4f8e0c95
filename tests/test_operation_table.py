"""The operation table agrees with the spec, the typing protocol, the allocator and the contract.

One declaration per public call (``veloxquant_mlx_spec.operations``) is the
alphabet every checker derives from, so a declaration that disagrees with
any of them fails here, by name: its fields are the spec transition's
parameters, the protocol method's and ``BlockPoolAllocator``'s, with the
same defaults; every rule it cites is a heading of docs/CONTRACT.md.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import MISSING
from pathlib import Path
from typing import get_args

import pytest

from veloxquant_mlx.memory.block_pool import AllocationStats, BlockPoolAllocator
from veloxquant_mlx_spec import model, operations
from veloxquant_mlx_spec.operations import (
    Allocate,
    BlockPool,
    CheckedBlockPool,
    Free,
    MarkUsed,
    NFree,
    Operation,
    Stats,
)
from veloxquant_mlx_spec.table import (
    ArgKind,
    Declaration,
    Handle,
    Raised,
    Returned,
    declaration_of,
    declarations,
    h,
    observation_ops,
    spec_call,
    spec_outcome,
)

REPO = Path(__file__).resolve().parents[1]
POOL_CALLS = declarations("pool")
#: Keys a trace line uses for itself; no parameter may be named like one.
TRACE_KEYS = {"op", "call", "expect", "returned", "message", "thread", "invoke_ns", "return_ns"}


def _parameters(function: object, *, skip: int) -> list[tuple[str, object]]:
    signature = inspect.signature(function)  # type: ignore[arg-type]
    listed = list(signature.parameters.values())[skip:]
    return [
        (p.name, MISSING if p.default is inspect.Parameter.empty else p.default) for p in listed
    ]


def _fields(declaration: Declaration) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in declaration.parameters]


def _method(owner: type, declaration: Declaration) -> object:
    return inspect.getattr_static(owner, declaration.path[-1])


@pytest.mark.parametrize("declaration", POOL_CALLS, ids=lambda d: d.name)
def test_a_calls_fields_are_its_spec_transitions_parameters(declaration: Declaration) -> None:
    assert _parameters(declaration.transition, skip=1) == _fields(declaration)


@pytest.mark.parametrize("declaration", POOL_CALLS, ids=lambda d: d.name)
def test_a_calls_fields_are_the_allocators_parameters(declaration: Declaration) -> None:
    owner = (
        AllocationStats
        if declaration.path[0] == "stats" and len(declaration.path) > 1
        else (BlockPoolAllocator)
    )
    found = _method(owner, declaration)
    if declaration.is_property:
        # A property, or the getset descriptor mypyc compiles one to: read-only data.
        assert inspect.isdatadescriptor(found), declaration.name
        assert declaration.parameters == ()
    else:
        assert _parameters(found, skip=1) == _fields(declaration)


@pytest.mark.parametrize("declaration", POOL_CALLS, ids=lambda d: d.name)
def test_a_call_is_in_the_typing_protocol_with_the_same_parameters(
    declaration: Declaration,
) -> None:
    protocol = CheckedBlockPool if declaration.source == "P" else BlockPool
    if declaration.path[0] == "stats" and len(declaration.path) > 1:
        found = _method(operations.StatsLike, declaration)
    else:
        found = _method(protocol, declaration)
    if declaration.is_property:
        assert isinstance(found, property), declaration.name
    else:
        assert _parameters(found, skip=1) == _fields(declaration)


def test_the_protocol_declares_no_call_the_table_lacks() -> None:
    names = {d.path[0] for d in POOL_CALLS}
    members = {
        name
        for name in vars(CheckedBlockPool) | vars(BlockPool)
        if not name.startswith("_") and name != "config"
    }
    assert members == names


def test_the_operation_union_is_every_declared_pool_call() -> None:
    assert set(get_args(Operation)) == {d.op for d in POOL_CALLS}


def test_every_rule_a_call_cites_is_a_rule_of_the_contract() -> None:
    contract = (REPO / "docs" / "CONTRACT.md").read_text()
    ids = set(re.findall(r"^### (C-[A-Z0-9-]+)$", contract, re.MULTILINE))
    ids |= {anchor.upper() for anchor in re.findall(r'<a id="(inv-[a-z-]+)">', contract)}
    for declaration in POOL_CALLS:
        assert declaration.rules, declaration.name
        assert set(declaration.rules) <= ids, (declaration.name, set(declaration.rules) - ids)


def test_no_parameter_is_named_like_a_key_of_a_trace_line() -> None:
    for declaration in declarations(None):
        assert not {p.name for p in declaration.parameters} & TRACE_KEYS, declaration.name


def test_queries_change_no_state_and_say_so() -> None:
    state = model.new_pool(model.SpecConfig(2, 4), 4)
    assert isinstance(state, model.PoolState)
    for declaration in POOL_CALLS:
        if not declaration.changes_state:
            good = [
                declaration.domains[p.name].good(state.config)[0]
                for p in declaration.parameters
                if p.kind is ArgKind.VALUE
            ]
            if len(good) == len(declaration.parameters):
                after, _ = spec_call(state, declaration.op(*good), lambda ref: 0)
                assert after == state, declaration.name


def test_a_domains_small_values_are_good_and_its_bad_values_are_refused() -> None:
    state = model.new_pool(model.SpecConfig(2, 4, separate_kv=True), 4)
    assert isinstance(state, model.PoolState)
    state, _ = spec_call(state, Allocate("k", 1, 0), lambda ref: 0)
    for declaration in POOL_CALLS:
        values = [p for p in declaration.parameters if p.kind is ArgKind.VALUE]
        if len(values) != len(declaration.parameters):
            continue
        for position, parameter in enumerate(values):
            domain = declaration.domains[parameter.name]
            assert set(domain.small(state.config)) <= set(domain.good(state.config))
            firsts = [declaration.domains[p.name].small(state.config)[0] for p in values]
            for bad in domain.bad(state.config):
                arguments = [*firsts[:position], bad, *firsts[position + 1 :]]
                _, result = spec_call(state, declaration.op(*arguments), lambda ref: 0)
                assert isinstance(result, model.Err), (declaration.name, arguments)


def test_argument_kinds_come_from_the_field_types() -> None:
    kinds = {d.name: [p.kind for p in d.parameters] for d in POOL_CALLS}
    assert kinds["free"] == [ArgKind.HANDLES]
    assert kinds["mark_used"] == [ArgKind.HANDLE, ArgKind.VALUE]
    assert kinds["allocate"] == [ArgKind.VALUE] * 4


def test_handles_are_named_by_call_and_position_and_print_as_code() -> None:
    assert h(3, 0) == Handle(3, 0)
    assert repr(Free((h(0, 1), h(0, 0)))) == "Free(blocks=(h(0, 1), h(0, 0)))"
    assert sorted([h(1, 0), h(0, 2)]) == [h(0, 2), h(1, 0)]


def test_spec_outcomes_name_new_handles_by_block_id_and_others_by_name() -> None:
    state = model.new_pool(model.SpecConfig(4, 8), 4)
    assert isinstance(state, model.PoolState)
    names = {0: h(7, 0), 1: h(7, 1)}
    after, result = spec_call(state, Allocate("k", 5, 1), lambda ref: 0)
    assert spec_outcome(declaration_of(Allocate("k", 5, 1)), after, result, names.__getitem__) == (
        Returned((0, 1))
    )
    blocks_for = operations.BlocksFor(1)
    _, held = spec_call(after, blocks_for, lambda ref: 0)
    assert spec_outcome(declaration_of(blocks_for), after, held, names.__getitem__) == Returned(
        (h(7, 0), h(7, 1))
    )
    _, error = spec_call(after, MarkUsed(h(7, 0), 9), lambda ref: 0)
    assert spec_outcome(declaration_of(MarkUsed(h(7, 0), 9)), after, error, names.__getitem__) == (
        Raised("ValueError")
    )
    _, stats = spec_call(after, Stats(), lambda ref: 0)
    assert spec_outcome(declaration_of(Stats()), after, stats, names.__getitem__) == Returned(
        (8, 1, 0, 0, 0, 0, 0, 2, 2, 0.125)
    )


def test_an_error_outcome_compares_by_its_class_only() -> None:
    assert Raised("ValueError", "n_used must be <= 4") == Raised("ValueError", "other words")
    assert Raised("ValueError") != Raised("TypeError")


def test_observations_cover_every_query_over_its_observation_points() -> None:
    config = model.SpecConfig(2, 4, separate_kv=False)
    observed = observation_ops(config, owners=[5], handles=[h(0, 0)])
    names = {declaration_of(op).name for op in observed}
    assert names == {
        "blocks_for",
        "n_free",
        "stats",
        "history",
        "is_live",
        "id_bound",
        "check_invariants",
        "shared_blocks",
        "n_shares",
        "n_copy_on_write",
    }
    assert [op for op in observed if isinstance(op, NFree)] == [NFree(s) for s in ("k", "v", "kv")]
