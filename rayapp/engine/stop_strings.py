"""Stop strings found in streamed text in time linear in the text, whatever the stop list.

An Aho-Corasick automaton over the stop strings, built once per request in time linear in their total
length, reads the output one character at a time. Its state is the longest end of the text read so far
that begins some stop string, which is also how much text must be held back from the client.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    """Reads text piece by piece (`feed`) and reports the first stop string it completes."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        # The trie: node 0 is the empty string; `_goto[node]` maps a character to the next node.
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        # The stop string (its index, the first listed of equal ones) that is the longest end of a node's string.
        self._best = [-1]
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                child = self._goto[node].get(ch)
                if child is None:
                    child = self._goto[node][ch] = len(self._goto)
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._best.append(-1)
                node = child
            if self._best[node] == -1:
                self._best[node] = index
        # Failure links: the node of the longest proper end of a node's string, found breadth first.
        self._fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            if self._best[node] == -1:
                self._best[node] = self._best[self._fail[node]]
            for ch, child in self._goto[node].items():
                self._fail[child] = self._next(self._fail[node], ch)
                queue.append(child)
        self._state = 0

    def _next(self, state: int, ch: str) -> int:
        while state and ch not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(ch, 0)

    @property
    def partial_len(self) -> int:
        """Length of the longest end of the text read so far that is the beginning of a stop string."""
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Read `text` (the continuation of what was read before). Of the stop strings that end inside it,
        the one that starts earliest (then the first listed): `(start, index)`, with `start` counted from the
        beginning of `text` (negative when the match began in earlier text). None when none ends there."""
        if not self.stops:
            return None
        hit: tuple[int, int] | None = None
        state = self._state
        for pos, ch in enumerate(text):
            state = self._next(state, ch)
            index = self._best[state]
            if index != -1:
                # The longest stop ending here starts earliest of those ending here.
                found = (pos + 1 - len(self.stops[index]), index)
                hit = found if hit is None or found < hit else hit
        self._state = state
        return hit
