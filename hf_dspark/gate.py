"""The realized gate: whether drafting pays, judged by what whole rounds have actually delivered on this machine.

``generate()`` keeps one at one request (the scheduler policy with ``realized_gate``); the batched engine keeps one
per engine (``EngineMeasurements``), per batch size.

This file is self-contained (standard library only): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

REALIZED_WINDOW = 32  # whole rounds per (batch size, drafted) behind the realized gate's tokens per second, at least
# A window also holds at least this many request-rounds (rows x rounds): at few rows, 32 rounds are one or two
# requests' text, and how predictable that text was (which the cost model already prices step by step, from the
# drafts' confidences) would decide the verdict instead of what drafting costs. SmolLM2 at one request (bf16, 2 CPU
# threads, 32-token answers): 32-round windows dipped to within 3% of plain over a hard answer or two, ruling drafting
# out for 16 or more rounds of the next ones although drafting delivered 1.5x plain over the run; at 16 requests and
# more the window is 32 rounds as before.
REALIZED_REQUEST_ROUNDS = 512
REMEASURE_ROUNDS = 2  # fresh drafting rounds a re-measurement of a losing drafting side runs before its verdict
# Rounds each side needs at a batch size before a verdict there. With one plain round against two drafting ones, a
# single plain step's timing decided whether drafting ran for a whole ``explore_interval``.
VERDICT_ROUNDS = 2
# Drafting wins a verdict only when it delivers this much more than plain rounds. A re-measurement is judged on a
# few rounds, and drafting that truly loses by 10% (SmolLM2 at 16 requests) still "wins" some of them by chance; a
# wrong "draft" also costs what the rounds do not show (drafting desynchronises a batch's requests, so more of them
# join one by one, each join a prefill and a cache copy), while a wrong "plain" only forgoes a small gain.
DRAFTING_MARGIN = 1.03
# A losing drafting side is re-measured only once the plain rounds run since it last drafted are long enough that the
# re-measurement's expected loss (REMEASURE_ROUNDS drafting rounds at the measured shortfall) is at most this fraction
# of their time: drafting that lost narrowly is re-measured soon, one that lost badly (SmolLM2 at 64 requests: 45%)
# rarely, so exploring costs at most about this fraction of the time wherever drafting loses. SmolLM2 at 16 requests
# (bf16, 2 CPU threads), where drafting steps deliver 15-30% less than plain ones: at 2% the warm runs spent 2-7 of
# their ~110 steps re-measuring drafting, about 1% of their time.
EXPLORE_BUDGET = 0.005
# While drafting wins, plain rounds are taken only now and then (``explore_interval`` apart), so the plain window's
# rounds span many more rounds than the drafting window's, and a shared machine's speed drifts in between (here: ten
# plain runs at 16 requests, one command, read 190 to 250 tokens/s). The verdict then compares the last
# ``MATCHED_PLAIN_ROUNDS`` plain rounds with the drafting rounds of the same stretch (``compared_rates``): a plain
# window measured in a slow minute kept drafting on at 16 requests for 22-42 of a run's ~120 steps (windows of 269
# against 286 tok/s, while plain steps then ran at 345), and the runs read 0.88-0.98 of plain.
MATCHED_PLAIN_ROUNDS = 4


def realized_window(rows: int) -> int:
    """Rounds a realized window holds at ``rows`` requests: ``REALIZED_WINDOW``, or enough for
    ``REALIZED_REQUEST_ROUNDS`` request-rounds (512 rounds at one request, 128 at four, 32 from sixteen)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return max(REALIZED_WINDOW, -(-REALIZED_REQUEST_ROUNDS // rows))


class RoundWindow(deque):
    """A realized window: the last ``maxlen`` rounds' ``(tokens emitted, seconds)``, with their totals kept as rounds
    come and go (a 512-round window is read a few times every round; summing it each time cost more than the
    decision it serves)."""

    def __init__(self, rounds=(), maxlen: int | None = None):
        super().__init__(((float(e), float(s)) for e, s in rounds), maxlen)
        self.tokens = sum(e for e, _ in self)
        self.seconds = sum(s for _, s in self)

    def append(self, round_: tuple[float, float]) -> None:
        emitted, seconds = float(round_[0]), float(round_[1])
        if self.maxlen is not None and len(self) == self.maxlen:
            old_emitted, old_seconds = self[0]
            self.tokens -= old_emitted
            self.seconds -= old_seconds
        super().append((emitted, seconds))
        self.tokens += emitted
        self.seconds += seconds

    def __reduce__(self):  # copies and pickles rebuild the totals from the rounds
        return type(self), (list(self), self.maxlen)

    def _refuse(self, *args, **kwargs):
        raise TypeError("a RoundWindow only takes rounds through append (its totals follow append alone)")

    appendleft = extend = extendleft = insert = remove = pop = popleft = clear = rotate = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def rate(self, last: int | None = None) -> float | None:
        """Tokens per second of the window (of its ``last`` rounds when given), or None when empty."""
        if last is None:
            tokens, seconds, count = self.tokens, self.seconds, len(self)
        else:
            recent = list(itertools.islice(reversed(self), max(0, last)))
            tokens, seconds, count = sum(e for e, _ in recent), sum(s for _, s in recent), len(recent)
        if not count:
            return None
        return tokens / seconds if seconds > 0 else float("inf")


class RealizedGate:
    """Judges drafting by what it has actually delivered on this machine.

    ``realized[(rows, drafted)]`` holds ``(tokens emitted, seconds)`` of the last ``realized_window(rows)`` whole rounds
    (drafter, context catch-up, verification and bookkeeping) at ``rows`` active requests, with drafting or without;
    their rate is total tokens over total seconds, so one slow round (a hiccup of a shared machine) moves it by a
    thirty-second (less in longer windows), not by the 30% a moving average would. Every cost a model of the round
    leaves out or misprices shows up here. The verdicts read past rounds only, so a gate that only chooses whether
    to draft is lossless.
    The batched engine keeps one per engine (``EngineMeasurements``); ``generate()`` keeps one at ``rows = 1``.
    """

    def __init__(self):
        self.realized: dict[tuple[int, bool], RoundWindow] = {}
        # Exploration state (not saved: a loaded file starts a fresh schedule of re-measurements)
        self.steps_since: dict[tuple[int, bool], int] = {}  # rounds at R since the last (drafting, plain) round
        self.plain_seconds: dict[int, float] = {}  # R -> seconds of plain rounds at R since its last drafting round
        self.explore_wait: dict[int, int] = {}  # R -> rounds before drafting is re-measured while it loses
        # R -> drafting rounds since its last re-measurement began (absent: the whole window counts)
        self.fresh_rounds: dict[int, int] = {}
        # R -> rounds recorded at R; (R, drafted) -> the round numbers of the window's newest rounds (not saved: a
        # loaded window's rounds have none, and verdicts use whole windows until plain rounds are numbered again)
        self.round_count: dict[int, int] = {}
        self.round_numbers: dict[tuple[int, bool], deque[int]] = {}

    def record_step(self, rows: int, drafted: bool, emitted: int, seconds: float) -> None:
        """One whole round at ``rows`` requests: whether it drafted, the tokens it emitted, its seconds."""
        key = (rows, drafted)
        window = self.realized.get(key)
        if window is None:
            window = self.realized[key] = RoundWindow(maxlen=realized_window(rows))
        window.append((emitted, seconds))
        self.round_count[rows] = self.round_count.get(rows, 0) + 1
        self.round_numbers.setdefault(key, deque(maxlen=realized_window(rows))).append(self.round_count[rows])
        self.steps_since[key] = 0
        self.plain_seconds[rows] = 0.0 if drafted else self.plain_seconds.get(rows, 0.0) + float(seconds)
        if drafted and rows in self.fresh_rounds:
            self.fresh_rounds[rows] += 1
            if self.fresh_rounds[rows] >= realized_window(rows):  # the window holds fresh rounds only
                del self.fresh_rounds[rows]
        other = (rows, not drafted)
        self.steps_since[other] = self.steps_since.get(other, 0) + 1

    def realized_rate(self, rows: int, drafted: bool, last: int | None = None) -> float | None:
        """Tokens per second of the recent whole rounds at ``rows`` requests (with drafting or without; only the
        ``last`` ones when given), or None."""
        window = self.realized.get((rows, drafted))
        return None if window is None else window.rate(last)

    # -- the realized gate ---------------------------------------------------------------------------------------
    def drafting_allowed(self, rows: int, explore_interval: int, max_explore_interval: int,
                         explore_budget: float = EXPLORE_BUDGET, representative: bool = True,
                         catch_up: float = 0.0) -> bool:
        """Whether a round (an engine step) at ``rows`` requests may draft, judged by the tokens per second recent
        whole rounds delivered there: free until drafting has been measured twice (``VERDICT_ROUNDS``); then plain
        rounds at once until the plain side has been measured twice there (and one every ``explore_interval``
        rounds while drafting wins, to keep the plain side fresh; scaled by the window, ``realized_window(rows) /
        REALIZED_WINDOW``: every 16 * ``explore_interval`` rounds at one request); otherwise the faster side,
        re-measuring a losing drafting side after a wait that starts at ``explore_interval`` and doubles (up to
        ``max_explore_interval``) while drafting keeps losing, and that also lasts until the expected loss of the
        re-measurement (``REMEASURE_ROUNDS`` drafting rounds at the measured shortfall) is at most ``explore_budget``
        of the plain rounds' seconds since drafting last ran (``remeasure_loss``; never past ``max_explore_interval``
        rounds; 0 turns this off). A re-measurement drafts ``REMEASURE_ROUNDS`` rounds and is judged on its own rounds (then on
        every round since it began, up to the window), not on the window of the stretch that made drafting lose.

        A batch size where drafting has not been measured twice yet takes the verdict of the nearest smaller one
        where both sides were: when drafting loses there, it is presumed to lose here too (each verified draft
        widens a larger batch, and the budget shrinks with load), so a rising load does not pay a full-width
        drafting step at every new batch size to learn what the smaller ones already showed. Those smaller batch
        sizes keep re-measuring drafting; once it wins there, the larger ones are free to try again. It also takes a
        loss measured at the nearest larger size up to twice its own (``drafting_lost_nearby``), so a draining batch
        does not re-learn it at every size. A size presumed to lose from a neighbour is still measured itself, on
        the schedule of a loss measured there (the wait, then the budget, priced by the neighbour's shortfall): the
        neighbour's rounds may have been other work, e.g. the last tokens of a draining batch, whose drafts are
        capped short, and a load that then settles at this size would otherwise never draft again. Drafting wins a
        verdict only by ``DRAFTING_MARGIN``.

        ``representative=False`` marks a round unlike most (the engine: one where most requests take their first
        step after the prompt, whose drafts are accepted about twice as often as later ones): it drafts only on a
        verdict already measured, never as one of the few rounds that measure drafting (unmeasured, or re-measured),
        which wait for the next round instead. Two such rounds would make a verdict that later rounds overturn only
        after drafting has lost through a window of them.

        ``catch_up``: seconds a drafting round now would spend before it drafts, bringing the drafter's context up to
        date with what plain rounds verified since it last ran (the batched engine projects those features lazily,
        when a row next drafts). A re-measurement of a losing side pays it on its first round, and it is lost with
        the re-measurement when drafting still loses, so it is priced with ``remeasure_loss`` against the budget.
        The rounds' own rates already carry the catch-ups they paid; this prices the next one."""
        allowed, action = self.drafting_verdict(rows, explore_interval, max_explore_interval, explore_budget,
                                                representative, catch_up)
        if action == "reset":  # drafting wins: a later loss starts from the shortest wait again
            self.explore_wait[rows] = explore_interval
        elif action == "remeasure":
            # Re-measure drafting now, judged on REMEASURE_ROUNDS new rounds alone: the rounds from before the wait
            # came from other text (a hard stretch that made drafting lose), and one new round added to them could
            # hardly change the verdict, so a passing bad stretch would keep drafting off for ever longer waits.
            self.explore_wait[rows] = min(2 * self.explore_wait.get(rows, explore_interval), max_explore_interval)
            self.fresh_rounds[rows] = 0
        return allowed

    def drafting_verdict(self, rows: int, explore_interval: int, max_explore_interval: int,
                         explore_budget: float = EXPLORE_BUDGET, representative: bool = True,
                         catch_up: float = 0.0) -> tuple[bool, str | None]:
        """``drafting_allowed``'s verdict without changing any state: (allowed, action), the action being
        ``"reset"`` (drafting wins: its wait starts over), ``"remeasure"`` (a re-measurement of a losing drafting
        side starts now) or None. A caller may ask it as often as it likes, e.g. to skip everything else a round's
        drafting decision costs when the gate rules drafting out anyway."""
        if not math.isfinite(catch_up) or catch_up < 0:
            raise ValueError(f"catch_up must be a finite number of seconds >= 0, got {catch_up}")
        allowed, action = self._verdict(rows, explore_interval, max_explore_interval, explore_budget, catch_up)
        if allowed and action != "reset" and not representative:
            return False, None  # a round that would measure drafting: wait for a representative one
        return allowed, action

    def _verdict(self, rows: int, explore_interval: int, max_explore_interval: int,
                 explore_budget: float, catch_up: float = 0.0) -> tuple[bool, str | None]:
        drafting = self.realized.get((rows, True))
        fresh = self.fresh_rounds.get(rows)
        if fresh is not None and fresh < REMEASURE_ROUNDS:
            return True, None  # a re-measurement under way: its verdict comes from its own rounds
        if drafting is None or len(drafting) < VERDICT_ROUNDS:
            loser = self.nearby_loss(rows)
            if loser is None:
                return True, None  # not measured here: free, unless a size it follows lost
            # Presumed to lose here from a size nearby, whose rounds may have been other work (a draining batch's
            # last tokens, their drafts capped short): measure it here too, on the schedule a loss measured here
            # would get, the expected loss priced by the nearby size's rounds.
            return self._remeasure_verdict(rows, loser, self.realized_rate(loser, False), explore_interval,
                                           max_explore_interval, explore_budget, catch_up)
        plain = self.realized.get((rows, False))
        if plain is None or len(plain) < VERDICT_ROUNDS:
            # Drafting is measured here and plain not yet enough: measure plain now. A plain round costs nothing next
            # to plain decoding, while every drafting round run before the verdict may be a loss.
            return False, None
        drafting_rate, plain_rate = self.compared_rates(rows)
        # the plain side is refreshed at the same pace relative to its window at every batch size: a round every
        # explore_interval at 16 requests and more, every 16 * explore_interval at one request (512-round windows)
        refresh = explore_interval * realized_window(rows) // REALIZED_WINDOW
        fresh_plain = self.steps_since.get((rows, False), 0) < refresh
        if drafting_rate >= DRAFTING_MARGIN * plain_rate:
            return fresh_plain, "reset"  # a stale plain side is re-measured too: a slow step there must not stick
        return self._remeasure_verdict(rows, rows, plain_rate, explore_interval, max_explore_interval,
                                       explore_budget, catch_up)

    def _remeasure_verdict(self, rows: int, priced_by: int, plain_rate: float, explore_interval: int,
                           max_explore_interval: int, explore_budget: float,
                           catch_up: float = 0.0) -> tuple[bool, str | None]:
        """Drafting loses at ``rows``: re-measure it once the wait is over and the expected loss (``remeasure_loss``
        of the rounds at ``priced_by``, against ``plain_rate``, plus the ``catch_up`` its first round pays) is within
        ``explore_budget`` of the plain rounds' time since drafting last ran at ``rows`` (or ``max_explore_interval``
        rounds have passed)."""
        since = self.steps_since.get((rows, True), 0)
        if since < self.explore_wait.get(rows, explore_interval):
            return False, None
        if (explore_budget > 0 and since < max_explore_interval
                and explore_budget * self.plain_seconds.get(rows, 0.0)
                < self.remeasure_loss(priced_by, plain_rate) + catch_up):
            return False, None  # drafting lost by so much that re-measuring now would spend more than the budget
        return True, "remeasure"

    def remeasure_loss(self, rows: int, plain_rate: float) -> float:
        """Expected seconds a re-measurement of drafting at ``rows`` loses against plain rounds: ``REMEASURE_ROUNDS``
        drafting rounds of the window's mean length, times the fraction of them plain rounds would have saved."""
        window = self.realized.get((rows, True))
        drafting_rate = self.drafting_rate(rows)
        if not window or drafting_rate is None or plain_rate <= 0:
            return 0.0
        shortfall = max(0.0, 1.0 - drafting_rate / plain_rate)
        return REMEASURE_ROUNDS * window.seconds / len(window) * shortfall

    def drafting_lost_nearby(self, rows: int) -> bool:
        """Whether drafting delivered less than ``DRAFTING_MARGIN`` times plain rounds' tokens per second at the
        largest batch size below ``rows``, or at the smallest one above it up to ``2 * rows``, where both sides were
        measured (each at least ``VERDICT_ROUNDS`` times). Below: the budget shrinks as load grows. Above, within a
        factor of two: a batch draining from a size where drafting lost (requests finishing one by one) would
        otherwise pay two drafting rounds at every size on the way down to learn the same thing."""
        return self.nearby_loss(rows) is not None

    def nearby_loss(self, rows: int) -> int | None:
        """The batch size whose loss ``drafting_lost_nearby`` finds for ``rows`` (the one below first), or None."""
        measured = [r for (r, drafted), window in self.realized.items()
                    if drafted and r != rows and r <= 2 * rows and len(window) >= VERDICT_ROUNDS
                    and len(self.realized.get((r, False), ())) >= VERDICT_ROUNDS]
        below = [r for r in measured if r < rows]
        above = [r for r in measured if r > rows]
        for r in ([max(below)] if below else []) + ([min(above)] if above else []):
            drafting_rate, plain_rate = self.compared_rates(r)
            if drafting_rate < DRAFTING_MARGIN * plain_rate:
                return r
        return None

    def compared_rates(self, rows: int) -> tuple[float | None, float | None]:
        """The drafting and plain rates a verdict at ``rows`` compares: the last ``MATCHED_PLAIN_ROUNDS`` plain rounds
        against the drafting rounds recorded since the first of them (only those of a re-measurement, once it has
        run its rounds), when there are ``VERDICT_ROUNDS`` of those: both sides from the same stretch, so a machine
        that ran slower or faster when the plain side was last measured does not decide. Otherwise (too few
        numbered rounds) ``drafting_rate`` against the whole plain window."""
        plain_numbers = self.round_numbers.get((rows, False))
        drafting_numbers = self.round_numbers.get((rows, True))
        if plain_numbers and drafting_numbers and len(plain_numbers) >= MATCHED_PLAIN_ROUNDS:
            start = plain_numbers[-MATCHED_PLAIN_ROUNDS]
            since = sum(1 for _ in itertools.takewhile(lambda n: n > start, reversed(drafting_numbers)))
            fresh = self.fresh_rounds.get(rows)
            if fresh is not None and fresh >= REMEASURE_ROUNDS:
                since = min(since, fresh)
            if since >= VERDICT_ROUNDS:
                return (self.realized_rate(rows, True, last=since),
                        self.realized_rate(rows, False, last=MATCHED_PLAIN_ROUNDS))
        return self.drafting_rate(rows), self.realized_rate(rows, False)

    def drafting_rate(self, rows: int) -> float | None:
        """The drafting side's rate behind the verdicts at ``rows``: the rounds since the last re-measurement began
        once it has run its ``REMEASURE_ROUNDS``, else the whole window (the verdict before it)."""
        fresh = self.fresh_rounds.get(rows)
        return self.realized_rate(rows, True, last=fresh if fresh is not None and fresh >= REMEASURE_ROUNDS else None)
