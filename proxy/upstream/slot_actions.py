"""The child's slot save and restore (``POST /slots/ID?action=save|restore``), for the disk tier.

Only the proxy asks these of its own child, over the per-boot secret: the ``/slots`` routes are closed to
every key at the door (``proxy.routes.table``), so no request ever names a file. The file name is one the
tier chose inside the child's ``--slot-save-path`` folder; llama-server refuses any name that is not a
plain file name (``fs_validate_filename``). Answers (tools/server/server-task.cpp
``server_task_result_slot_save_load::to_json``): ``n_saved``/``n_written``/``timings.save_ms`` and
``n_restored``/``n_read``/``timings.restore_ms``; a failure is an error object (a restore that does not fit
or fails to read leaves the slot cleared).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from proxy.conversations.tier import ACTION_TIMEOUT_S, SlotActionFailed, SlotResult
from proxy.errors import ProxyError
from proxy.source import UpstreamSnapshot
from proxy.upstream.connection import UpstreamClosed
from proxy.upstream.pool import Upstream


class ChildSlots:
    """The slot actions of the child ``snap`` names, for one request (its id goes along)."""

    def __init__(
        self, upstream: Upstream, snap: UpstreamSnapshot, request_id: str, timeout_s: float = ACTION_TIMEOUT_S
    ) -> None:
        self._upstream = upstream
        self._snap = snap
        self._request_id = request_id
        self._timeout_s = timeout_s

    async def save(self, slot: int, filename: str) -> SlotResult:
        answer = await self._act(slot, "save", filename)
        return SlotResult(_int(answer, "n_saved"), _int(answer, "n_written"), _ms(answer, "save_ms"))

    async def restore(self, slot: int, filename: str) -> SlotResult:
        answer = await self._act(slot, "restore", filename)
        return SlotResult(_int(answer, "n_restored"), _int(answer, "n_read"), _ms(answer, "restore_ms"))

    async def _act(self, slot: int, action: str, filename: str) -> dict[str, Any]:
        body = json.dumps({"filename": filename}).encode()
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._upstream.open(
                    self._snap, "POST", f"/slots/{slot}?action={action}", body, self._request_id
                )
                try:
                    content = await response.read()
                finally:
                    response.release()
        except TimeoutError:
            raise SlotActionFailed(f"slot {action} took longer than {self._timeout_s:g} s") from None
        except (ProxyError, UpstreamClosed) as exc:
            raise SlotActionFailed(f"slot {action}: {exc}") from None
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        if response.status != 200 or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            raise SlotActionFailed(f"slot {action}: {response.status} {message or ''}".strip())
        return answer


def _int(answer: dict[str, Any], name: str) -> int:
    value = answer.get(name)
    return value if isinstance(value, int) else 0


def _ms(answer: dict[str, Any], name: str) -> float:
    timings = answer.get("timings")
    value = timings.get(name) if isinstance(timings, dict) else None
    return float(value) if isinstance(value, int | float) else 0.0
