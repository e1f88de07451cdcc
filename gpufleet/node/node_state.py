"""A node's place in the fleet: its state, the moves between states, and the history of every move (a node tool,
standard library only: the node's own watch and the controller's commands move a node by the same rules).

    new -> burn-in -> serving -> suspect -> quarantined -> (burn-in -> serving) | retired

A node's record (``gpufleet.node-state/1``, one JSON file per node on the monitoring hosts) holds its state, the
state of each GPU by serial, the clean burn-in passes since it last left ``serving``, its quarantines, and every move
(when, from, to, why, by whom, the evidence). Every function here is pure: it takes a record and returns the next
one, or refuses the move with one line. Replicas are placed only on ``serving`` nodes (:func:`places_replicas`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

SCHEMA = "gpufleet.node-state/1"
State = Literal["new", "burn-in", "serving", "suspect", "quarantined", "retired"]
STATES: tuple[State, ...] = ("new", "burn-in", "serving", "suspect", "quarantined", "retired")
# Who may move a node where: the automatic path and people's commands alike (retired -> burn-in needs force).
MOVES: dict[State, tuple[State, ...]] = {
    "new": ("burn-in", "quarantined", "retired"),
    "burn-in": ("serving", "quarantined", "retired"),
    "serving": ("suspect", "burn-in", "quarantined", "retired"),
    "suspect": ("serving", "burn-in", "quarantined", "retired"),
    "quarantined": ("burn-in", "retired"),
    "retired": (),
}
FORCED_MOVES: dict[State, tuple[State, ...]] = {"retired": ("burn-in",)}
IN_SERVICE: tuple[State, ...] = ("serving", "suspect")  # the node keeps (and a deploy places) replicas
OUT_OF_SERVICE: tuple[State, ...] = ("quarantined", "retired")  # the node left: drained, its replicas stopped
Record = dict[str, Any]


class MoveRefused(Exception):
    """The state machine does not allow this move; the message says which moves it does."""


@dataclass(frozen=True)
class Policy:
    """The bounds of the lifecycle (the ``node_lifecycle_`` settings)."""

    readmit_passes: int = 2  # clean full passes a quarantined node needs before it serves again
    cool_off_s: int = 600  # the first cool-off after a quarantine; it doubles with each quarantine in the window
    retire_after: int = 3  # quarantines within retire_window_s that retire the node
    retire_window_s: int = 7 * 86400


def now_text(now: datetime) -> str:
    return now.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def new_record(host: str, now: datetime) -> Record:
    """A node gpufleet has never seen: no GPU known yet, nothing in its history."""
    return {"schema": SCHEMA, "host": host, "state": "new", "since": now_text(now), "gpus": {}, "clean_passes": 0,
            "quarantines": [], "history": [], "last_burn_in": None}


MAX_HISTORY = 10000  # moves a record may hold: a node's whole life, far short of what would burden its disk


def _time_text(value: Any) -> bool:
    try:
        return isinstance(value, str) and len(value) <= 40 and bool(parse_time(value))
    except ValueError:
        return False


def _text(value: Any, longest: int = 2000) -> bool:
    return isinstance(value, str) and len(value) <= longest and value.isprintable()


def record_problem(record: Any, host: str) -> str | None:
    """Why ``record`` is not a record of ``host`` this tool can keep (the right fields, each of its type: times that
    parse, states it knows, printable words, at most :data:`MAX_HISTORY` moves), or None."""
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        return f"expected a {SCHEMA} record"
    if record.get("host") != host:
        return f"expected a record of {host}"
    if record.get("state") not in STATES or not _time_text(record.get("since")):
        return "expected a known state and the time it began"
    passes = record.get("clean_passes")
    if not isinstance(passes, int) or isinstance(passes, bool) or not 0 <= passes <= MAX_HISTORY:
        return "expected clean_passes, a count"
    if not isinstance(record.get("gpus"), dict) or not (record.get("last_burn_in") is None
                                                        or isinstance(record.get("last_burn_in"), dict)):
        return "expected gpus and last_burn_in as mappings"
    quarantines, history = record.get("quarantines"), record.get("history")
    if not isinstance(quarantines, list) or not all(_time_text(q) for q in quarantines):
        return "expected quarantines, a list of times"
    if not isinstance(history, list) or len(history) > MAX_HISTORY:
        return f"expected a history of at most {MAX_HISTORY} moves"
    for move in history:
        if not (isinstance(move, dict) and _time_text(move.get("at")) and move.get("from") in STATES
                and move.get("to") in STATES and _text(move.get("why"), 1000)
                and _text(move.get("by", "gpufleet"), 200)
                and isinstance(move.get("evidence", {}), dict)):
            return "expected each move of the history with its time, states and printable words"
    return None


def parse_record(text: str | None) -> Record | None:
    """A record from its JSON text; None for none, or for text that is not a record."""
    try:
        doc = json.loads(text or "null")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None


def newer(a: Record | None, b: Record | None) -> Record | None:
    """Of two copies of one node's record, the one with the longer history (the later last move on a tie); either
    when the other is None."""
    if a is None or b is None:
        return a or b

    def key(r: Record) -> tuple[int, str]:
        return len(r.get("history") or []), str((r.get("history") or [{}])[-1].get("at", ""))

    return a if key(a) >= key(b) else b


def places_replicas(record: Record | None) -> bool:
    """Whether a deploy may place replicas on the node: only a serving one (a suspect node keeps what it runs)."""
    return record is not None and record.get("state") in IN_SERVICE


def out_of_service(record: Record | None) -> str | None:
    """Why a node with this record gets no replica, or None: it left the fleet, or is being readmitted (its watch
    brings it back). A node with no record, or a new one, is admitted by the deploy that places its replicas."""
    if record is None or record.get("state") in IN_SERVICE or record.get("state") == "new" \
            or (record.get("state") == "burn-in" and not full_burn_in_due(record)):
        return None
    last = (record.get("history") or [{}])[-1]
    return f"the node is {record.get('state')} since {record.get('since')}: {last.get('why', 'no reason kept')}"


def full_burn_in_due(record: Record) -> bool:
    """Whether a node in burn-in runs the full tier, its replicas stopped: one readmitted after a quarantine, or one
    a person took out of service for it (``requested``); a new node's admission is the deploy's quick tier."""
    return record.get("state") == "burn-in" and bool(record.get("quarantines") or record.get("requested"))


def allowed(state: State, force: bool = False) -> tuple[State, ...]:
    return MOVES[state] + (FORCED_MOVES.get(state, ()) if force else ())


def move(record: Record, to: State, why: str, now: datetime, by: str = "gpufleet",
         evidence: dict[str, Any] | None = None, force: bool = False) -> Record:
    """The record after moving the node to ``to``; :class:`MoveRefused` when the state machine does not allow it."""
    state: State = record["state"]
    if to not in allowed(state, force):
        choices = ", ".join(allowed(state)) or "none"
        hint = " (with --force: burn-in)" if state in FORCED_MOVES and not force else ""
        raise MoveRefused(f"{record['host']}: cannot move from {state} to {to}: from {state} the moves are "
                          f"{choices}{hint}")
    out = copy.deepcopy(record)
    out["history"].append({"at": now_text(now), "from": state, "to": to, "why": why, "by": by,
                           "evidence": evidence or {}})
    out["state"], out["since"] = to, now_text(now)
    if to == "quarantined":
        out["quarantines"].append(now_text(now))
    if to in ("quarantined", "suspect", "retired") or (to == "burn-in" and state in ("retired", *IN_SERVICE)):
        out["clean_passes"] = 0
    # a node in service sent to burn-in: a full burn-in on request, its replicas drained and stopped meanwhile
    out["requested"] = to == "burn-in" and (state in IN_SERVICE or bool(record.get("requested")))
    return out


def quarantines_in_window(record: Record, now: datetime, policy: Policy) -> int:
    start = now - timedelta(seconds=policy.retire_window_s)
    return sum(1 for at in record["quarantines"] if parse_time(at) > start)


def cool_off(record: Record, now: datetime, policy: Policy) -> timedelta:
    """How long a quarantined node rests before its readmission burn-in: doubled for each earlier quarantine in the
    window."""
    earlier = max(0, quarantines_in_window(record, now, policy) - 1)
    return timedelta(seconds=policy.cool_off_s * 2**earlier)


def readmission_due(record: Record, now: datetime, policy: Policy) -> bool:
    """A quarantined node whose cool-off has passed is due its readmission burn-in."""
    return record["state"] == "quarantined" and now >= parse_time(record["since"]) + cool_off(record, now, policy)


def quarantine(record: Record, why: str, now: datetime, policy: Policy, by: str = "gpufleet",
               evidence: dict[str, Any] | None = None) -> Record:
    """Quarantine the node; the quarantine that makes ``retire_after`` in the window retires it instead, with a note
    for the vendor."""
    out = move(record, "quarantined", why, now, by, evidence)
    if quarantines_in_window(out, now, policy) >= policy.retire_after:
        note = vendor_note(out, now, policy)
        out = move(out, "retired", f"{policy.retire_after} quarantines within "
                   f"{policy.retire_window_s // 86400} days", now, by, {"vendor_note": note})
    return out


def after_burn_in(record: Record, verdict: dict[str, Any], now: datetime, policy: Policy) -> Record:
    """The record after a burn-in verdict (``gpufleet.burn-in/1``): a failure quarantines the node with the failed
    checks as evidence; a pass counts, and admits the node once enough have passed (one for a new node,
    ``readmit_passes`` of the full tier after a quarantine)."""
    out = copy.deepcopy(record)
    summary = {"tier": verdict.get("tier"), "passed": bool(verdict.get("passed")), "at": now_text(now),
               "seconds": verdict.get("seconds"),
               "failed": [c for c in verdict.get("checks", []) if c.get("status") == "fail"],
               "gpus": sorted({int(c["gpu"]) for c in verdict.get("checks", []) if c.get("gpu") is not None})}
    out["last_burn_in"] = summary
    _note_gpus(out, verdict)
    if not summary["passed"]:
        if out["state"] in ("quarantined", "retired"):
            return out
        return quarantine(out, f"burn-in {summary['tier']} failed", now, policy, evidence={"burn_in": summary})
    if out["state"] == "new":
        out = move(out, "burn-in", "first seen", now)
    if out["state"] != "burn-in":
        return out
    requested = bool(out.get("requested"))
    readmission = bool(out["quarantines"]) and not requested
    if (readmission or requested) and summary["tier"] != "full":
        return out
    out["clean_passes"] += 1
    needed = policy.readmit_passes if readmission else 1
    if out["clean_passes"] >= needed:
        out = move(out, "serving", f"{out['clean_passes']} clean burn-in pass(es)", now,
                   evidence={"burn_in": summary})
    return out


def _note_gpus(record: Record, verdict: dict[str, Any]) -> None:
    """Each GPU's last result, by serial where the verdict names one (else by index)."""
    for check in verdict.get("checks", []):
        gpu = check.get("gpu")
        if gpu is None:
            continue
        key = check.get("evidence", {}).get("serial") or f"index-{gpu}"
        entry = record["gpus"].setdefault(key, {"index": gpu, "failed": []})
        if check.get("status") == "fail":
            entry["failed"].append({"check": check.get("check"), "evidence": check.get("evidence", {})})
            entry["failed"] = entry["failed"][-10:]


def vendor_note(record: Record, now: datetime, policy: Policy) -> str:
    """What a vendor asks for when a node goes back: the GPUs' serials, the findings and their dates."""
    start = now - timedelta(seconds=policy.retire_window_s)
    lines = [f"Node {record['host']}: retired on {now_text(now)} after "
             f"{quarantines_in_window(record, now, policy)} quarantines since {now_text(start)}."]
    serials = sorted(k for k in record["gpus"] if not k.startswith("index-"))
    lines.append(f"GPU serials: {', '.join(serials) if serials else 'not reported'}.")
    for entry in record["history"]:
        if entry["to"] == "quarantined" and parse_time(entry["at"]) > start:
            lines.append(f"{entry['at']}: {entry['why']}")
    return "\n".join(lines)
