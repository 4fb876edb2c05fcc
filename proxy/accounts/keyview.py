"""The store's keys in memory, for the request path: a dict lookup and one constant-time comparison.

A poll thread asks the store for its key marker a few times a second (``POLL_S``); only when it moved
(a key made, revoked, rotated or re-budgeted by any process: ``llamagate keys``, an admin route, another
tool, another replica on the same PostgreSQL database) does it read the keys again and swap in a new
dict. A change is in force within one poll plus one read, well under a second. Revoked keys are not in
the dict; expired ones are, and are refused by the lookup at the time of the request, so expiry needs no
poll at all. Revoked, expired and unknown keys get the same answer (None): the caller's 401 cannot tell
them apart.

If the store cannot be read, the view keeps the keys it has (one log line; the next good poll says it
is back): a broken disk must not lock every client out, and a revocation made while the store is
unreadable could not have been written anyway.

``touch`` records a key's last use in memory (to the second: a use within a second of the one recorded
is not written again); the writer stores those in its batches, never per request.
"""

from __future__ import annotations

import hmac
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.accounts.records import KeyRecord
from proxy.accounts.store import Store
from proxy.auth import Principal, key_digest
from proxy.settings import BudgetSettings

log = logging.getLogger("llamagate.accounts")

POLL_S = 0.2
TOUCH_EVERY_S = 1.0
_KEY_RE = re.compile(r"lg_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")
_NO_DIGEST = "sha256:" + "0" * 64


@dataclass(frozen=True, slots=True)
class AccountKey:
    """What the request path needs of a store key. ``principal`` is the same record config keys give."""

    principal: Principal
    digest: str
    models: tuple[str, ...]  # () = every model the tenant may use
    budgets: BudgetSettings
    expires: float | None

    @classmethod
    def of(cls, record: KeyRecord) -> AccountKey:
        return cls(
            Principal(record.tenant, record.key_id, record.scopes, record.models, record.budgets),
            record.digest,
            record.models,
            record.budgets,
            record.expires,
        )

    @property
    def tenant(self) -> str:
        return self.principal.tenant

    @property
    def key_id(self) -> str:
        return self.principal.key_id


class KeyView:
    def __init__(self, store: Store, poll_s: float = POLL_S) -> None:
        self._store = store
        self.poll_s = poll_s
        self._keys: Mapping[str, AccountKey] = {}
        self._marker: int | None = None
        self._touched: dict[str, float] = {}
        self._touch_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.reloads = 0  # how many times the keys were read (tests, and a debug line)

    def __len__(self) -> int:
        return len(self._keys)

    # -- the request path ---------------------------------------------------------------------------

    def find(self, key_id: str, digest: str, now: float) -> AccountKey | None:
        """The key with this id and digest, if it is active at ``now``; else None."""
        key = self._keys.get(key_id)
        # Compared even when the id is unknown, so an unknown id and a wrong secret take the same time.
        if not hmac.compare_digest(digest, key.digest if key is not None else _NO_DIGEST) or key is None:
            return None
        if key.expires is not None and now >= key.expires:
            return None
        return key

    def authenticate(self, token: str, now: float) -> AccountKey | None:
        """The bearer token as the client sent it (``lg_<id>_<secret>``)."""
        match = _KEY_RE.fullmatch(token)
        if match is None:
            return None
        return self.find(match.group(1), key_digest(token), now)

    def touch(self, key_id: str, now: float) -> None:
        # A key touched less than a second ago is left as it is (the lock and the write skipped: most
        # requests come from keys in use), so its last use may be that much older; the writer's
        # batches, which store it, are a second apart anyway.
        if self._touched.get(key_id, -TOUCH_EVERY_S) + TOUCH_EVERY_S > now:
            return
        with self._touch_lock:
            self._touched[key_id] = now

    # -- the writer ---------------------------------------------------------------------------------

    def take_touches(self) -> tuple[tuple[str, float], ...]:
        with self._touch_lock:
            out, self._touched = tuple(self._touched.items()), {}
        return out

    def put_back_touches(self, touches: tuple[tuple[str, float], ...]) -> None:
        with self._touch_lock:
            for key_id, at in touches:
                if self._touched.get(key_id, 0.0) < at:
                    self._touched[key_id] = at

    # -- the poll -----------------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Read the keys again if the store's marker moved; whether it did. Raises ``StoreError``."""
        marker = self._store.key_marker()
        if marker == self._marker:
            return False
        records = self._store.load_keys()
        self._keys = {r.key_id: AccountKey.of(r) for r in records}  # one reference swap: readers never lock
        self._marker = marker
        self.reloads += 1
        return True

    def start(self) -> None:
        """Load now (so a bad store fails the start), then poll on a thread of its own."""
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="llamagate-keyview", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception as exc:  # StoreError, or a bug: either way the poll must go on
                if not self._failing:
                    log.error("key store: cannot read, keeping the %d keys in memory: %s", len(self), exc)
                self._failing = True
            else:
                if self._failing:
                    log.warning("key store: readable again; keys are current")
                self._failing = False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
