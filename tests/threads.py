"""Running a call on a fresh, named thread and handing its exception back.

Shared by the tests that check what a store does when a second thread calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_thread(name: str, call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` on a new thread called ``name``; the exception it raised, if any."""
    raised: list[BaseException] = []

    def body() -> None:
        try:
            call()
        except BaseException as error:  # handed to the calling thread
            raised.append(error)

    thread = threading.Thread(target=body, name=name)
    thread.start()
    thread.join()
    return raised[0] if raised else None
