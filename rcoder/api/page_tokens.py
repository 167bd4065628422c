"""``ListSessions`` page tokens: opaque to clients, and good only for the order they were made in.

By session_id a token is the last session_id listed, base64url (as before there were other orders,
so a token of an older daemon goes on working). By cost it is ``cost `` and the JSON array
``[currency, cost in nanos or null, session_id]``, base64url: the listing goes on after that session
at that cost (keyset paging), so a page never repeats a session whose cost did not change meanwhile.
The cost is a session's place in the order, never wider than ``COST_ORDER_LIMIT_NANOS`` (the
stores hold it there): every part of a token is checked, and anything else is ``InvalidArgument``.
A session_id has no spaces, so the two kinds never mix up.

``ListRuns`` tokens are ``runs `` and the JSON array ``[session_id, started_at, run_id]`` (the last
run listed; ``started_at`` ISO-8601 with its offset), base64url: good only for that session's
listing, every part checked as for sessions.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime

from rcoder import errors
from rcoder.api import validate
from rcoder.domain import COST_ORDER_LIMIT_NANOS, SessionOrder
from rcoder.session.sessions.queries import After

_COST = "cost "
_RUNS = "runs "
_NOT_A_TOKEN = "not a token from a previous ListSessions answer"  # noqa: S105 (a message, not a password)


def encode(order: SessionOrder, currency: str, after: After | None) -> str:
    if after is None:
        return ""
    text = after.session_id
    if order is SessionOrder.COST_DESC:
        text = _COST + json.dumps([currency, after.cost_nanos, after.session_id])
    return base64.urlsafe_b64encode(text.encode()).decode()


def decode(token: str, order: SessionOrder, currency: str) -> After | None:
    """Where the page ``token`` asks for starts; ``InvalidArgument`` when it is no token of ours or
    was made for another order or currency."""
    if not token:
        return None
    try:
        text = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
        if text.startswith(_COST):
            made_in, after = _cost_position(text.removeprefix(_COST))
        else:
            validate.identifier(text, "page_token", required=True)
            made_in, after = (SessionOrder.SESSION_ID, ""), After(text)
    except (binascii.Error, UnicodeError, ValueError, TypeError, errors.InvalidArgument):
        raise errors.InvalidArgument("page_token", _NOT_A_TOKEN) from None
    if made_in != (order, currency):
        made_order, made_currency = made_in
        by = "cost in " + made_currency if made_order is SessionOrder.COST_DESC else "session_id"
        raise errors.InvalidArgument(
            "page_token", f"made for the order by {by}: send the order_by and cost_currency of the request it came from"
        )
    return after


def _cost_position(text: str) -> tuple[tuple[SessionOrder, str], After]:
    currency, cost, session_id = json.loads(text)  # ValueError or TypeError when not three values
    if not isinstance(currency, str) or not isinstance(session_id, str):
        raise TypeError(text)
    if cost is not None and (not isinstance(cost, int) or isinstance(cost, bool)):
        raise TypeError(text)
    if cost is not None and abs(cost) > COST_ORDER_LIMIT_NANOS:  # the stores make none wider
        raise ValueError(text)
    validate.identifier(session_id, "page_token", required=True)
    return (SessionOrder.COST_DESC, currency), After(session_id, cost)


def encode_runs(session_id: str, after: tuple[datetime, str] | None) -> str:
    if after is None:
        return ""
    text = _RUNS + json.dumps([session_id, after[0].isoformat(), after[1]])
    return base64.urlsafe_b64encode(text.encode()).decode()


def decode_runs(token: str, session_id: str) -> tuple[datetime, str] | None:
    """Where the ``ListRuns`` page ``token`` asks for starts; ``InvalidArgument`` when it is no
    token of ours or was made for another session's runs."""
    if not token:
        return None
    not_ours = "not a token from a previous ListRuns answer"
    try:
        text = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
        if not text.startswith(_RUNS):
            raise ValueError(text)
        made_for, started, run_id = json.loads(text.removeprefix(_RUNS))
        if not all(isinstance(part, str) for part in (made_for, started, run_id)):
            raise TypeError(text)
        at = datetime.fromisoformat(started)
        if at.utcoffset() is None:
            raise ValueError(started)
        validate.identifier(made_for, "page_token", required=True)
        validate.identifier(run_id, "page_token", required=True)
    except (binascii.Error, UnicodeError, ValueError, TypeError, errors.InvalidArgument):
        raise errors.InvalidArgument("page_token", not_ours) from None
    if made_for != session_id:
        raise errors.InvalidArgument("page_token", "made for another session's runs: send the session_id it came from")
    return at, run_id
