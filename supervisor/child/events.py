"""What the state machine consumes (events: observations of the child and requests) and what it
produces (actions for the driver). Plain frozen values; events about a child carry its generation so
news from a previous child can be told apart and ignored."""

from __future__ import annotations

import enum
from dataclasses import dataclass


# --- events (observations) -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Stop:
    reason: str = "stop requested"


@dataclass(frozen=True)
class Restart:
    """Restart the child now (a llama setting changed), or leave FAILED on an operator's request.

    ``trial``: the next child runs new settings while the previous ones are known to work; if it fails
    before passing the readiness gate, the machine rolls back (``Action.ROLLBACK``) instead of
    counting a crash."""

    reason: str
    trial: bool = False


@dataclass(frozen=True)
class SpawnFailed:
    generation: int
    reason: str


@dataclass(frozen=True)
class Output:
    generation: int


@dataclass(frozen=True)
class GatePassed:
    generation: int


@dataclass(frozen=True)
class GateFailed:
    generation: int
    reason: str


@dataclass(frozen=True)
class HealthOk:
    generation: int


@dataclass(frozen=True)
class HealthFailed:
    generation: int
    reason: str


@dataclass(frozen=True)
class LoopAsked:
    """The liveness probe put a task in llama-server's queue (``GET /slots``): the server loop owes an
    answer within ``Policy.loop_deadline_s`` of this event (a probe already owed keeps its time)."""

    generation: int


@dataclass(frozen=True)
class LoopAnswered:
    """The server loop answered the probe's task: it is turning (busy or idle, not held)."""

    generation: int


@dataclass(frozen=True)
class Exited:
    generation: int
    description: str  # decoded by the driver: "exited with code 1", "killed by SIGSEGV", ...


Event = (
    Start
    | Tick
    | Stop
    | Restart
    | SpawnFailed
    | Output
    | GatePassed
    | GateFailed
    | HealthOk
    | HealthFailed
    | LoopAsked
    | LoopAnswered
    | Exited
)


# --- actions -------------------------------------------------------------------------------------------
class Action(enum.Enum):
    SPAWN = "spawn"  # new generation: pick a port and secret, start the child, watch it, start the gate
    START_LIVENESS = "start_liveness"
    STOP_PROBES = "stop_probes"
    TERMINATE = "terminate"  # SIGTERM
    KILL = "kill"  # SIGKILL
    ROLLBACK = "rollback"  # a trial child failed: put the last settings that passed the gate back


class After(enum.Enum):
    """What STOPPING leads to once the child has exited."""

    STOP = "stop"
    RESTART = "restart"  # after a failure: BACKOFF
    RESTART_NOW = "restart_now"  # config change: start again at once
    GIVE_UP = "give_up"  # FAILED
    ROLLBACK = "rollback"  # a trial failed: start again at once on the previous settings
