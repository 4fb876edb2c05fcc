"""``bench conversations --across handover``: nginx's access log says where each conversation went (the
id its hash used, the same one llamagate and the bench derive), the moved conversations' reuse is
reported apart from the others', and the event is refused where it means nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.conversations.key import conversation_id
from supervisor.bench import conversations
from supervisor.bench.conversations import TargetResult, Turn, Workload
from supervisor.bench.nginx import Nginx
from supervisor.cli import main


def test_the_access_log_names_each_requests_conversation(tmp_path: Path) -> None:
    (tmp_path / "access.log").write_text(
        "200|127.0.0.1:1|200|0.5|opening:abc\n"
        "200|127.0.0.1:1, 127.0.0.1:2|502, 200|0.7|-\n"
        "200|127.0.0.1:3|200|0.1\n"  # the format before the id was logged
    )
    records = Nginx(None, 0, tmp_path).access_log()  # type: ignore[arg-type]
    assert [r.conversation for r in records] == ["opening:abc", "", ""]
    assert records[1].tried == ["127.0.0.1:1", "127.0.0.1:2"]


def test_the_bench_names_its_conversations_as_nginx_does() -> None:
    work = Workload(conversations=3, turns=2)
    ids = [conversation_id([], {"messages": m}) for m in conversations.openings(work)]
    assert len(set(ids)) == 3 and all(i is not None and i.startswith("opening:") for i in ids)


def test_the_moved_conversations_are_measured_apart() -> None:
    r = TargetResult("replicas-shared", event="handover", event_turn=2, moved=[1])
    for c, cached in ((0, 100), (1, 50)):
        r.turns += [Turn(c, 0, 100, 0, 8, 0.1), Turn(c, 1, 200, 100, 8, 0.1, 108)]
        r.turns.append(Turn(c, 2, 300, cached * 2, 8, 0.1, 208))
    s = r.summary()
    assert (s["moved_conversations"], s["stayed_conversations"]) == (1, 1)
    assert s["moved_of_reusable"] == pytest.approx(100 / 208)
    assert s["stayed_of_reusable"] == pytest.approx(200 / 208)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--targets", "llamagate", "--across", "handover"], "only the replicas targets"),
        (["--targets", "replicas", "--across", "kill"], "not for the replicas targets"),
        (["--targets", "replicas", "--across", "handover", "--replicas", "1"], "--replicas 2 or more"),
    ],
)
def test_handover_is_for_replicas_only(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "conversations", *argv, "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
