"""What crosses the pipe between a replica and its engine's process (`EngineProcess`): one dataclass per message.

Each is pickled whole, so a request keeps its type (`EngineRequest`) and an error keeps its class and fields
(a `LimitError`'s `param` and `code` reach the client's 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayapp.drivers.backend import GenerateDelta
from rayapp.engine.request import EngineRequest

# Parent → child.


@dataclass(frozen=True)
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Call:
    """Ask the child for `name` (`abort`, `stats`, `metrics`, `take_kv_events`, `kv_snapshot`, `cached_blocks`,
    `flush_tier`);
    answered by a `Reply` with the same `call_id`."""

    call_id: int
    name: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Shutdown:
    pass


# Child → parent.


@dataclass(frozen=True)
class Started:
    """Sent once: the engine is built (`error` None) or could not be (`error` says why)."""

    error: str | None = None


@dataclass(frozen=True)
class Outputs:
    """One step's deltas, by request id (one event-loop wakeup per step on the parent's side)."""

    deltas: list[tuple[str, GenerateDelta]]


@dataclass(frozen=True)
class Rejected:
    """The engine refused a request (the client's error: a ValueError, often a `LimitError`)."""

    request_id: str
    error: ValueError


@dataclass(frozen=True)
class Ended:
    """An engine failure ended these requests."""

    reason: str
    request_ids: list[str]


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    error: BaseException | None = None
