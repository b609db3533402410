"""`StopStrings`: one Aho-Corasick automaton over a request's stop strings, so that finding them
in the output costs time in the new text only, independent of how many stop strings there are.

The automaton's states are the prefixes of the stop strings (a trie); a state's failure link is
its longest proper suffix that is also a state. Fed the output one character at a time, the
current state is the longest suffix of the text so far that is a prefix of some stop string:

    step(state, c) = child(state, c) if it exists, else step(fail(state), c) (the root: itself)

amortised O(1) per character (each failure link shortens the state). At each position the
longest stop string ending there is ``longest[state]`` (its own length if the state is a whole
stop string, else that of its failure link's, 0 for none), so the earliest stop-string start
among the matches that end at a position is ``end - longest[state]``. The state's depth is the
text a later character could still complete into a stop string: exactly what must be held back.

Building takes time and memory linear in the stop strings' total length (at most
``MAX_STOP_STRINGS`` x ``MAX_STOP_STRING_CHARS`` characters, checked by `SamplingParams`).
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence


class StopStrings:
    """The automaton of ``stops`` (non-empty strings); states are ints, 0 the root (empty text)."""

    def __init__(self, stops: Sequence[str]) -> None:
        children: list[dict[str, int]] = [{}]
        depth = [0]
        whole = [0]  # a state's own length if it is a whole stop string, else 0
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = children[state].get(ch)
                if nxt is None:
                    nxt = len(children)
                    children[state][ch] = nxt
                    children.append({})
                    depth.append(depth[state] + 1)
                    whole.append(0)
                state = nxt
            whole[state] = depth[state]
        fail = [0] * len(children)
        longest = list(whole)
        queue = deque(children[0].values())
        while queue:  # breadth first: a state's failure link is shallower, so it is done first
            state = queue.popleft()
            for ch, child in children[state].items():
                link = fail[state]
                while link and ch not in children[link]:
                    link = fail[link]
                fail[child] = children[link].get(ch, 0)
                longest[child] = whole[child] or longest[fail[child]]
                queue.append(child)
        self._children = children
        self._fail = fail
        self._longest = longest
        self.depth = depth  # depth[state]: the length of the text the state stands for

    def scan(self, state: int, text: str, start: int, floor: int) -> tuple[int, Optional[int]]:
        """Feed ``text[start:]`` from ``state``; returns the state after it and the earliest start
        of a stop string that ends within ``text[start:]`` and past ``floor`` characters (None
        for no such match). Only the positions up to the first match are fed: the caller cuts
        the text there and the request ends."""
        children, fail, longest = self._children, self._fail, self._longest
        for i in range(start, len(text)):
            ch = text[i]
            while state and ch not in children[state]:
                state = fail[state]
            state = children[state].get(ch, 0)
            if longest[state] and i + 1 > floor:
                return state, i + 1 - longest[state]
        return state, None
