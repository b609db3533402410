"""`StopStrings`: one Aho-Corasick automaton over a request's stop strings, so that finding them
in the output costs time in the new text only, independent of how many stop strings there are;
built lazily, so that a request pays for the part of it its own text visits, never for the
whole list up front.

The automaton's states are the prefixes of the stop strings (a trie); a state's failure link is
its longest proper suffix that is also a state. Fed the output one character at a time, the
current state is the longest suffix of the text so far that is a prefix of some stop string:

    step(state, c) = child(state, c) if it exists, else step(fail(state), c) (the root: itself)

amortised O(1) per character (each failure link shortens the state). At each position the
longest stop string ending there is ``longest(state)`` (its own length if the state is a whole
stop string, else that of its failure link's, 0 for none), so the earliest stop-string start
among the matches that end at a position is ``end - longest(state)``. The state's depth is the
text a later character could still complete into a stop string: exactly what must be held back.

Lazy: the trie is the sorted stop strings themselves. A state is ``index * width + depth``: the
prefix of that depth of the first stop string (in sorted order) that has it, so each prefix has
one number (0: the root). A child is the next character of that string, or else found by a
binary search among the strings that share the prefix (O(log n) comparisons). Failure links and
``longest`` are computed the first time a state needs them, with the states they need in turn
(iteratively: no recursion), and kept. Building is a sort; the work and memory a request adds
are in proportion to the states its text reaches, at most the eagerly built automaton's (linear
in the stop strings' total length, at most ``MAX_STOP_STRINGS`` x ``MAX_STOP_STRING_CHARS``
characters, checked by `SamplingParams`).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Optional, Sequence


class StopStrings:
    """The automaton of ``stops`` (non-empty strings); states are ints, 0 the root (empty text)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = sorted(set(stops))
        self._width = max(map(len, self._stops), default=0) + 1  # states: index * width + depth
        self._fail: dict[int, int] = {}  # state -> its failure link, once computed
        self._longest: dict[int, int] = {0: 0}  # state -> the longest stop string that ends it, once computed

    def depth(self, state: int) -> int:
        """The length of the text ``state`` stands for."""
        return state % self._width

    def _state(self, prefix: str, lo: int = 0, hi: Optional[int] = None) -> Optional[int]:
        """The state of ``prefix`` (searching sorted indices ``lo`` to ``hi``), None if no stop
        string begins with it."""
        i = bisect_left(self._stops, prefix, lo, len(self._stops) if hi is None else hi)
        if i < len(self._stops) and self._stops[i].startswith(prefix):
            return i * self._width + len(prefix)
        return None

    def _child(self, state: int, ch: str) -> Optional[int]:
        """The state of ``state``'s text followed by ``ch``, None if that is no state. A string
        with that prefix sorts at or after ``state``'s first string."""
        i, d = divmod(state, self._width)
        stop = self._stops[i]
        if d < len(stop) and stop[d] == ch:
            return state + 1  # the first string with the prefix is the first with the longer one
        return self._state(stop[:d] + ch, lo=i)

    def _fail_of(self, state: int) -> int:
        """``state``'s failure link, computed (with the links it needs) at first use:
        fail(p + c) = step(fail(p), c), the root's children failing to the root."""
        fail = self._fail
        todo = [state]
        while todo:  # each state pushed is shallower than the one that pushed it
            node = todo[-1]
            if node in fail:
                todo.pop()
                continue
            i, d = divmod(node, self._width)
            if d <= 1:
                fail[node] = 0
                todo.pop()
                continue
            stop = self._stops[i]
            parent = self._state(stop[:d - 1], hi=i + 1)
            assert parent is not None  # a prefix of a state is a state
            if parent not in fail:
                todo.append(parent)
                continue
            link = fail[parent]
            while True:
                child = self._child(link, stop[d - 1])
                if child is not None or link == 0:
                    fail[node] = child or 0
                    todo.pop()
                    break
                if link not in fail:
                    todo.append(link)  # needed first; then this node starts its walk again
                    break
                link = fail[link]
        return fail[state]

    def _longest_of(self, state: int) -> int:
        """The length of the longest stop string that ends ``state``'s text (0 for none)."""
        longest = self._longest
        chain = []
        while state not in longest:
            i, d = divmod(state, self._width)
            if len(self._stops[i]) == d:  # a whole stop string sorts first among those it begins
                longest[state] = d
                break
            chain.append(state)
            state = self._fail_of(state)
        value = longest[state]
        for node in chain:
            longest[node] = value
        return value

    def scan(self, state: int, text: str, start: int, floor: int) -> tuple[int, Optional[int]]:
        """Feed ``text[start:]`` from ``state``; returns the state after it and the earliest start
        of a stop string that ends within ``text[start:]`` and past ``floor`` characters (None
        for no such match). Only the positions up to the first match are fed: the caller cuts
        the text there and the request ends."""
        if not self._stops:
            return state, None
        for i in range(start, len(text)):
            ch = text[i]
            child = self._child(state, ch)
            while child is None and state:
                state = self._fail_of(state)
                child = self._child(state, ch)
            state = child or 0
            longest = self._longest_of(state) if state else 0
            if longest and i + 1 > floor:
                return state, i + 1 - longest
        return state, None
