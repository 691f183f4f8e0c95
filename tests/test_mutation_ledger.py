"""mutation/ledger.py: the verdicts it saves are the ones it writes back, and only those."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

LEDGER_SCRIPT = Path(__file__).resolve().parent.parent / "mutation" / "ledger.py"


def load_ledger_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_ledger", LEDGER_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ledger_module = load_ledger_module()

POOL = "veloxquant_mlx/memory/block_pool.py"
METHOD = "xǁBlockPoolAllocatorǁallocate"
EXIT_CODES: dict[str, int | None] = {
    f"veloxquant_mlx.memory.block_pool.{METHOD}__mutmut_1": 1,
    f"veloxquant_mlx.memory.block_pool.{METHOD}__mutmut_2": 0,
    f"veloxquant_mlx.memory.block_pool.{METHOD}__mutmut_10": None,
    "veloxquant_mlx.memory.block_pool.x__require_block_id__mutmut_3": 36,
    "veloxquant_mlx.memory.block_pool.x_untried__mutmut_1": None,
}
POOL_META = {
    "exit_code_by_key": EXIT_CODES,
    "hash_by_function_name": {METHOD: "aaa", "x__require_block_id": "bbb", "x_untried": "ccc"},
    "type_check_error_by_key": {},
    "durations_by_key": {},
    "estimated_durations_by_key": {},
}


def write_meta(root: Path, source: str, meta: dict[str, object]) -> None:
    path = root / f"{source}.meta"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(meta))


def test_restored_meta_files_hold_exactly_the_decided_verdicts_with_their_hashes(
    tmp_path: Path,
) -> None:
    write_meta(tmp_path / "before", POOL, POOL_META)
    ledger = ledger_module.ledger_of(tmp_path / "before")
    written = json.loads(ledger_module.ledger_text(ledger))
    assert written == ledger
    count = ledger_module.write_meta_files(written, tmp_path / "after")
    restored = json.loads((tmp_path / "after" / f"{POOL}.meta").read_text())
    decided = {key: code for key, code in EXIT_CODES.items() if code is not None}
    assert count == 3
    assert restored["exit_code_by_key"] == decided
    assert restored["hash_by_function_name"] == {METHOD: "aaa", "x__require_block_id": "bbb"}


def test_a_ledger_of_another_format_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has format 2; expected 1"):
        ledger_module.write_meta_files({"format": 2, "files": {}}, tmp_path)
    assert not any(tmp_path.iterdir())
