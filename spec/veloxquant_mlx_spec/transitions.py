"""One pure function per public operation of `BlockPoolAllocator`.

A mutating operation takes a `PoolState` and the call's raw arguments
(typed `object` where the contract validates them) and returns
`(new_state, result)`, where `result` is the return value or an `Err`.
Arguments are checked in signature order, and on `Err` the state is
unchanged, except that exhaustion counts itself (`n_exhausted` and a
history snapshot). A query returns its result or an `Err`.
"""

from __future__ import annotations

from dataclasses import replace

from veloxquant_mlx_spec.model import (
    BlockId,
    Err,
    ErrorKind,
    ForeignBlock,
    HandleArg,
    HandleId,
    HandleView,
    NotABlock,
    NotAList,
    PoolState,
    is_int,
    live_handles,
    ref_count_of,
    stats,
    stream_names,
)

# ---- helpers -------------------------------------------------------------------


def storage_stream(state: PoolState, stream: object) -> str | Err:
    """The free list `stream` names: "k"/"v" always, "kv" only (and always) when shared."""
    names = stream_names(state.config)
    if not (isinstance(stream, str) and stream in names):
        return Err(ErrorKind.VALUE, f"stream must be one of {names}, got {stream!r}")
    return stream if state.config.separate_kv else "kv"


def free_list_for(state: PoolState, stream: str) -> tuple[BlockId, ...]:
    """The free-list stack of a storage stream; its top (next handed out) is last."""
    return dict(state.free_lists)[stream]


def _with_free_list(state: PoolState, stream: str, stack: tuple[BlockId, ...]) -> PoolState:
    lists = tuple((s, stack if s == stream else old) for s, old in state.free_lists)
    return replace(state, free_lists=lists)


def _with_handle(state: PoolState, h: HandleId, view: HandleView) -> PoolState:
    return replace(state, handles=(*state.handles[:h], view, *state.handles[h + 1 :]))


def _with_count(state: PoolState, block_id: BlockId, delta: int) -> PoolState:
    """`block_id`'s reference count moved by `delta`; an id whose count reaches 0 leaves."""
    counts = dict(state.ref_counts)
    counts[block_id] = counts.get(block_id, 0) + delta
    return replace(state, ref_counts=tuple(sorted((b, n) for b, n in counts.items() if n)))


def is_live(state: PoolState, block: HandleArg) -> bool:
    """`is_live(block)`: `block` is a handle of this pool that is still checked out."""
    return (
        is_int(block) and 0 <= block < len(state.handles) and state.handles[block].owner is not None
    )


def is_active(state: PoolState, owner: int) -> bool:
    """Holds a block, or is registered and not released since."""
    return owner in state.registered or any(v.owner == owner for v in state.handles)


def _recorded(before: PoolState, after: PoolState) -> PoolState:
    """Append a snapshot of `after` if the call changed a counter; keep the newest history_len."""
    unchanged = after.counters == before.counters and after.sharing == before.sharing
    if unchanged or after.history_len == 0:
        return after
    return replace(after, history=(*after.history, stats(after))[-after.history_len :])


def _owner_type_error(owner: object) -> Err:
    return Err(ErrorKind.TYPE, f"owner must be an int, got {owner!r}")


# ---- owners --------------------------------------------------------------------


def register_owner(state: PoolState, owner: object) -> tuple[PoolState, Err | None]:
    """`register_owner(owner)`: an already active owner raises OwnerAlreadyActiveError."""
    if not is_int(owner):
        return state, _owner_type_error(owner)
    if is_active(state, owner):
        return state, Err(ErrorKind.OWNER_ACTIVE, f"owner {owner} is already active")
    return replace(state, registered=state.registered | {owner}), None


def release_owner(state: PoolState, owner: object) -> tuple[PoolState, Err | None]:
    """`release_owner(owner)`: clears the registration only; held blocks stay held."""
    if not is_int(owner):
        return state, _owner_type_error(owner)
    return replace(state, registered=state.registered - {owner}), None


# ---- allocate ------------------------------------------------------------------


def _may_grow_by(state: PoolState, missing: int) -> bool:
    config = state.config
    cap = config.max_blocks
    return config.grow_on_exhaustion and (cap is None or stats(state).n_blocks + missing <= cap)


def _grown_ids(state: PoolState, count: int) -> tuple[BlockId, ...]:
    """Ids for `count` new blocks: lowest retired first, then above the highest ever issued."""
    reissued = tuple(sorted(state.retired))[:count]
    start = state.next_block_id
    return reissued + tuple(range(start, start + count - len(reissued)))


def allocate(
    state: PoolState, stream: object, n_tokens: object, owner: object, format: object = "fp16"
) -> tuple[PoolState, tuple[HandleId, ...] | Err]:
    """`allocate(...)`: ceil(n_tokens / block_size) blocks, popped from the top, then grown.

    Preserves every invariant (checked from new_pool by crosshair_drivers).
    """
    s = storage_stream(state, stream)
    if isinstance(s, Err):
        return state, s
    if not is_int(n_tokens):
        return state, Err(ErrorKind.TYPE, f"n_tokens must be an int, got {n_tokens!r}")
    if n_tokens <= 0:
        return state, Err(ErrorKind.VALUE, f"n_tokens must be a positive int, got {n_tokens}")
    if not is_int(owner):
        return state, _owner_type_error(owner)
    if not isinstance(format, str):
        return state, Err(ErrorKind.TYPE, f"format must be a str, got {format!r}")
    if not format:
        return state, Err(ErrorKind.VALUE, "format must be a non-empty str, got ''")
    size = state.config.block_size
    need = -(-n_tokens // size)
    stack = free_list_for(state, s)
    missing = max(0, need - len(stack))
    if missing and not _may_grow_by(state, missing):
        c = replace(state.counters, n_exhausted=state.counters.n_exhausted + 1)
        message = f"n_tokens={n_tokens} needs {need} blocks, {len(stack)} free on stream {s!r}"
        return _recorded(state, replace(state, counters=c)), Err(ErrorKind.EXHAUSTED, message)
    taken = stack[len(stack) - (need - missing) :][::-1]
    grown = _grown_ids(state, missing)
    ids = taken + grown
    views = tuple(
        HandleView(b, s, format, min(size, n_tokens - i * size), owner) for i, b in enumerate(ids)
    )
    c = state.counters
    c = replace(
        c,
        n_allocations=c.n_allocations + 1,
        n_reused=c.n_reused + len(state.ever_allocated & set(taken)),
        n_grown=c.n_grown + missing,
        peak_blocks_in_use=max(c.peak_blocks_in_use, stats(state).blocks_in_use + need),
    )
    for block_id in ids:
        state = _with_count(state, block_id, +1)
    after = replace(
        _with_free_list(state, s, stack[: len(stack) - len(taken)]),
        handles=state.handles + views,
        ever_allocated=state.ever_allocated | set(ids),
        retired=state.retired - set(grown),
        next_block_id=max([state.next_block_id, *(b + 1 for b in grown)]),
        counters=c,
    )
    return _recorded(state, after), tuple(range(len(state.handles), len(after.handles)))


# ---- free, free_all ------------------------------------------------------------


def _returned(state: PoolState, handles: tuple[HandleId, ...]) -> PoolState:
    """Release each handle, in order; a block whose count reaches 0 is pushed (C-FREE-SHARED)."""
    after = state
    for h in handles:
        view = after.handles[h]
        after = _with_count(after, view.block_id, -1)
        if ref_count_of(after, view.block_id) == 0:
            pushed = (*free_list_for(after, view.stream), view.block_id)
            after = _with_free_list(after, view.stream, pushed)
        after = _with_handle(after, h, replace(view, owner=None, n_used=0))
    still_holding = {after.handles[h].owner for h in live_handles(after)}
    emptied = {state.handles[h].owner for h in handles} - still_holding
    n_frees = state.counters.n_frees + (1 if handles else 0)
    return replace(
        after,
        registered=frozenset(o for o in after.registered if o not in emptied),
        counters=replace(after.counters, n_frees=n_frees),
    )


def free(
    state: PoolState, blocks: tuple[HandleArg, ...] | NotAList
) -> tuple[PoolState, Err | None]:
    """`free(blocks)`: all items checked first; each must be a live handle, listed once.

    Preserves every invariant (checked from new_pool by crosshair_drivers).
    """
    if isinstance(blocks, NotAList):
        return state, Err(ErrorKind.TYPE, "blocks must be a list or tuple of Block")
    for ref in blocks:
        if not is_live(state, ref):
            return state, Err(ErrorKind.INVALID_FREE, f"blocks item {ref!r} is not a live handle")
        if blocks.count(ref) > 1:
            return state, Err(ErrorKind.INVALID_FREE, f"blocks item {ref!r} is listed twice")
    handles = tuple(ref for ref in blocks if is_int(ref))
    return _recorded(state, _returned(state, handles)), None


def free_all(state: PoolState, owner: object) -> tuple[PoolState, Err | None]:
    """`free_all(owner)`: frees the owner's blocks in allocation order; always releases it.

    Preserves every invariant (checked from new_pool by crosshair_drivers).
    """
    if not is_int(owner):
        return state, _owner_type_error(owner)
    mine = tuple(h for h in live_handles(state) if state.handles[h].owner == owner)
    after = _returned(state, mine)
    return _recorded(state, replace(after, registered=after.registered - {owner})), None


# ---- shrink, mark_used ---------------------------------------------------------


def shrink(state: PoolState, stream: object, target_free: object) -> tuple[PoolState, int | Err]:
    """`shrink(stream, target_free)`: retires free blocks, highest id first; returns the count.

    Preserves every invariant (checked from new_pool by crosshair_drivers).
    """
    s = storage_stream(state, stream)
    if isinstance(s, Err):
        return state, s
    if not is_int(target_free):
        return state, Err(ErrorKind.TYPE, f"target_free must be an int, got {target_free!r}")
    if target_free < 0:
        return state, Err(ErrorKind.VALUE, f"target_free must be >= 0, got {target_free}")
    stack = free_list_for(state, s)
    doomed = frozenset(sorted(stack, reverse=True)[: max(0, len(stack) - target_free)])
    after = replace(
        _with_free_list(state, s, tuple(b for b in stack if b not in doomed)),
        retired=state.retired | doomed,
        ever_allocated=state.ever_allocated - doomed,
        counters=replace(state.counters, n_retired=state.counters.n_retired + len(doomed)),
    )
    return _recorded(state, after), len(doomed)


def mark_used(state: PoolState, block: HandleArg, n_used: object) -> tuple[PoolState, Err | None]:
    """`mark_used(block, n_used)`: sets that object's n_used; only a live handle moves stats.

    A `ForeignBlock` with owner None is accepted and changes no state: the
    harness sets that object's n_used itself. Never adds a history snapshot.

    Preserves every invariant (checked from new_pool by crosshair_drivers).
    """
    if isinstance(block, NotABlock):
        return state, Err(ErrorKind.TYPE, "block must be a Block")
    if not is_int(n_used):
        return state, Err(ErrorKind.TYPE, f"n_used must be an int, got {n_used!r}")
    if not 0 <= n_used <= state.config.block_size:
        limit = state.config.block_size
        return state, Err(ErrorKind.VALUE, f"n_used must be in [0, {limit}], got {n_used}")
    if isinstance(block, ForeignBlock):
        if block.owner is None:
            return state, None
        return state, Err(ErrorKind.VALUE, f"block with owner {block.owner} is not from this pool")
    if not 0 <= block < len(state.handles):
        return state, Err(ErrorKind.VALUE, f"block handle {block} was never issued by this pool")
    view = state.handles[block]
    count = ref_count_of(state, view.block_id)
    if view.owner is not None and count > 1:
        message = f"block {view.block_id} is shared (reference count {count}); it is read-only"
        return state, Err(ErrorKind.VALUE, message)
    return _with_handle(state, block, replace(view, n_used=n_used)), None


# ---- sharing (docs/CONTRACT.md#sharing) ------------------------------------------


def _shared(
    state: PoolState, handles: tuple[HandleId, ...], owner: int
) -> tuple[PoolState, tuple[HandleId, ...] | Err]:
    """A new handle for `owner` of each handle's block, in order; each count goes up by one."""
    mine = (state.handles[h] for h in live_handles(state))
    held = {view.block_id for view in mine if view.owner == owner}
    clash = [state.handles[h].block_id for h in handles if state.handles[h].block_id in held]
    if clash:
        return state, Err(ErrorKind.VALUE, f"owner {owner} already holds block id {clash[0]}")
    views = tuple(replace(state.handles[h], owner=owner) for h in handles)
    n_shares = state.sharing.n_shares + len(views)
    after = replace(
        state, handles=state.handles + views, sharing=replace(state.sharing, n_shares=n_shares)
    )
    for view in views:
        after = _with_count(after, view.block_id, +1)
    return _recorded(state, after), tuple(range(len(state.handles), len(after.handles)))


def share(
    state: PoolState, blocks: tuple[HandleArg, ...] | NotAList, owner: object
) -> tuple[PoolState, tuple[HandleId, ...] | Err]:
    """`share(blocks, owner)`: live handles, no id twice, then an owner holding none of them."""
    if isinstance(blocks, NotAList):
        return state, Err(ErrorKind.TYPE, "blocks must be a list or tuple of Block")
    ids: list[BlockId] = []
    for ref in blocks:
        if not is_live(state, ref):
            return state, Err(ErrorKind.INVALID_FREE, f"blocks item {ref!r} is not a live handle")
        block_id = state.handles[ref].block_id  # type: ignore[index]  # live: a serial
        if block_id in ids:
            message = f"blocks item {ref!r} names block id {block_id} twice"
            return state, Err(ErrorKind.INVALID_FREE, message)
        ids.append(block_id)
    if not is_int(owner):
        return state, _owner_type_error(owner)
    return _shared(state, tuple(ref for ref in blocks if is_int(ref)), owner)


def fork(
    state: PoolState, src_owner: object, dst_owner: object
) -> tuple[PoolState, tuple[HandleId, ...] | Err]:
    """`fork(src_owner, dst_owner)`: `share` of every live handle of the source, in order."""
    if not is_int(src_owner):
        return state, Err(ErrorKind.TYPE, f"src_owner must be an int, got {src_owner!r}")
    if not is_int(dst_owner):
        return state, Err(ErrorKind.TYPE, f"dst_owner must be an int, got {dst_owner!r}")
    if src_owner == dst_owner:
        message = f"dst_owner must differ from src_owner={src_owner}, got {dst_owner}"
        return state, Err(ErrorKind.VALUE, message)
    mine = tuple(h for h in live_handles(state) if state.handles[h].owner == src_owner)
    return _shared(state, mine, dst_owner)


def make_writable(state: PoolState, block: HandleArg) -> tuple[PoolState, HandleId | Err]:
    """`make_writable(block)`: itself at count 1; else its share moves to a new block.

    The new block is taken as `allocate` takes one (top of the stream's free
    list, else growth, else exhaustion, which counts itself).
    """
    if not is_live(state, block) or not is_int(block):
        return state, Err(ErrorKind.INVALID_FREE, f"block {block!r} is not a live handle")
    view = state.handles[block]
    if ref_count_of(state, view.block_id) == 1:
        return state, block
    stack = free_list_for(state, view.stream)
    c = state.counters
    if not stack and not _may_grow_by(state, 1):
        exhausted = replace(state, counters=replace(c, n_exhausted=c.n_exhausted + 1))
        message = f"block {block!r} needs a block to move to, 0 free on stream {view.stream!r}"
        return _recorded(state, exhausted), Err(ErrorKind.EXHAUSTED, message)
    new_id = stack[-1] if stack else _grown_ids(state, 1)[0]
    grown = () if stack else (new_id,)
    c = replace(
        c,
        n_reused=c.n_reused + (new_id in state.ever_allocated),
        n_grown=c.n_grown + len(grown),
        peak_blocks_in_use=max(c.peak_blocks_in_use, stats(state).blocks_in_use + 1),
    )
    moved = _with_handle(state, block, replace(view, owner=None, n_used=0))
    after = replace(
        _with_free_list(moved, view.stream, stack[:-1]) if stack else moved,
        handles=(*moved.handles, replace(view, block_id=new_id)),
        ever_allocated=state.ever_allocated | {new_id},
        retired=state.retired - set(grown),
        next_block_id=max(state.next_block_id, new_id + 1),
        counters=c,
        sharing=replace(state.sharing, n_copy_on_write=state.sharing.n_copy_on_write + 1),
    )
    after = _with_count(_with_count(after, view.block_id, -1), new_id, +1)
    return _recorded(state, after), len(state.handles)


# ---- queries -------------------------------------------------------------------


def blocks_for(state: PoolState, owner: object) -> tuple[HandleId, ...] | Err:
    """`blocks_for(owner)`: the owner's live handles in allocation order; () if none."""
    if not is_int(owner):
        return _owner_type_error(owner)
    return tuple(h for h in live_handles(state) if state.handles[h].owner == owner)


def n_free(state: PoolState, stream: object = "k") -> int | Err:
    """`n_free(stream)`: blocks on the stream's free list."""
    s = storage_stream(state, stream)
    return s if isinstance(s, Err) else len(free_list_for(state, s))


def ref_count(state: PoolState, block_id: object) -> int | Err:
    """`ref_count(block_id)`: the id's live handles; 0 if free, retired or never issued."""
    if not is_int(block_id):
        return Err(ErrorKind.TYPE, f"block_id must be an int, got {block_id!r}")
    if block_id < 0:
        return Err(ErrorKind.VALUE, f"block_id must be >= 0, got {block_id}")
    return ref_count_of(state, block_id)


def is_shared(state: PoolState, block_id: object) -> bool | Err:
    """`is_shared(block_id)`: its count is above 1, so no handle may write to it."""
    count = ref_count(state, block_id)
    return count if isinstance(count, Err) else count > 1


def id_bound(state: PoolState) -> int:
    """`id_bound()`: one more than the highest id that is free or checked out; 0 if none."""
    in_pool = [i for i in range(state.next_block_id) if i not in state.retired]
    return max(in_pool) + 1 if in_pool else 0
