"""What a client already has of a stream that may migrate: whole events, and their token ids.

With ``--migration-limit``, a streamed request on the token path asks its sidecar for the
output token ids of each event (``TokenizedRequest.stream_token_ids``): an SSE comment line
``: kvs-ids 1,2`` in front of the event. ``StreamTokens`` sits in the relay: it passes only
whole events on (a worker that dies mid-event leaves no half event with the client), strips
the comment lines and keeps the ids, so that a stream cut short can go on elsewhere from
exactly what the client has (``Exchange._migrate``).
"""

from __future__ import annotations

__all__ = ["StreamTokens"]

_IDS = b": kvs-ids "  # 10 bytes
_FINISHED = b'"finish_reason":"'
_FINISHED_SPACED = b'"finish_reason": "'
_DONE = b"data: [DONE]"
_CREATED = b'"created":'


class StreamTokens:
    """The whole events of one stream, as the client has them, and their output ids."""

    __slots__ = ("created", "events", "finished", "ids", "tail", "untracked")

    def __init__(self) -> None:
        self.tail = b""  # the start of an event not yet whole
        self.ids: list[int] = []  # output token ids of the events passed on
        self.events = 0  # ``data:`` events passed on
        self.untracked = 0  # of those, events that came without their ids (not resumable)
        self.finished = False  # an event with a finish reason (or [DONE]) passed on
        self.created: int | None = None  # the stream's ``created``

    def feed(self, pieces: list[bytes]) -> bytes:
        """The whole events ``pieces`` complete, their id comments taken out."""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if self.tail:
            data = self.tail + data
        elif data.startswith(_IDS) and data.find(b"\n\n") == len(data) - 2:
            # One whole event with its ids, as a sidecar writes it: the common case.
            line_end = data.find(b"\n")
            self._take(data[10:line_end])
            event = data[line_end + 1:]
            if event.startswith(b"data:"):
                self._count(event, True)
            return event
        end = data.rfind(b"\n\n")
        if end < 0:
            self.tail = data
            return b""
        end += 2
        self.tail = data[end:]
        events = data[:end].split(b"\n\n")
        events.pop()  # the empty piece after the last separator
        out: list[bytes] = []
        for raw in events:
            event = raw
            tracked = event.startswith(_IDS)
            if tracked:
                line_end = event.find(b"\n")
                self._take(event[10:] if line_end < 0 else event[10:line_end])
                if line_end < 0:  # ids with no event: nothing to show
                    continue
                event = event[line_end + 1:]
            if event.startswith(b"data:"):
                self._count(event, tracked)
            out.append(event + b"\n\n")
        return b"".join(out)

    def _take(self, line: bytes) -> None:
        if line:
            self.ids += map(int, line.split(b","))

    def _count(self, event: bytes, tracked: bool) -> None:
        self.events += 1
        if self.finished:
            return
        if _FINISHED in event or _FINISHED_SPACED in event or event.startswith(_DONE):
            self.finished = True
        elif not tracked:
            self.untracked += 1
        if self.created is None and (at := event.find(_CREATED)) >= 0:
            digits = event[at + len(_CREATED):at + len(_CREATED) + 24].lstrip()
            n = 0
            while n < len(digits) and 48 <= digits[n] <= 57:
                n += 1
            self.created = int(digits[:n]) if n else None

    @property
    def resumable(self) -> bool:
        """Whether the ids of everything the client has are known."""
        return not self.untracked
