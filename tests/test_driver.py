"""The JSON-lines driver: the kit and the exhaustive checker drive a port in another process.

Our own pool, served by ``python -m veloxquant_mlx.testing.driver``, passes the
whole kit through the protocol; a driver that dies, writes junk or answers
late ends the run with one ``DriverFailure`` naming the driver, never a hang.
"""

from __future__ import annotations

import json
import sys

import pytest

from veloxquant_mlx.testing.driven import DriverFailure, DriverProcess, driven_port
from veloxquant_mlx.testing.driver import PROTOCOL, PROTOCOL_VERSION
from veloxquant_mlx.testing.exhaustive import SCOPES, explore
from veloxquant_mlx.testing.report import conformance_report

DRIVER = [sys.executable, "-m", "veloxquant_mlx.testing.driver"]
HELLO = json.dumps({"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "calls": []})


@pytest.mark.slow
def test_our_pool_passes_the_whole_kit_through_the_driver() -> None:
    report = conformance_report(driven_port(DRIVER), depth=2, examples=20, time_budget=60)
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


def _fake(script: str) -> list[str]:
    return [sys.executable, "-c", script]


@pytest.mark.parametrize(
    ("script", "said"),
    [
        (f"print({HELLO!r}, flush=True)", "exited \\(status 0\\) before the response"),
        (f"print({HELLO!r}, flush=True); input(); print('oops', flush=True)", "not a JSON object"),
        (f"import time; print({HELLO!r}, flush=True); time.sleep(30)", "no answer within 0.5 s"),
        ("print('{}', flush=True)", "its hello is {}"),
    ],
    ids=["dies", "junk", "late", "no-hello"],
)
def test_a_broken_driver_is_one_clear_failure(script: str, said: str) -> None:
    with pytest.raises(DriverFailure, match=said):
        DriverProcess(_fake(script), timeout=0.5).request("pool", config={})
