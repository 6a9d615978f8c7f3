"""After the search, before the winner is chosen: a full-precision reference if the study has
none (low-precision trials are judged against it), and the contenders within noise of the
best measured again, interleaved, until the leader's lead exceeds the noise seen.

Both measure through the tuner (`Tuner.measure_now`), so their trials are stored in the
study like any other: a resumed tune does not take them again.
"""

import time

from loguru import logger

from autofit.search import choice, seeding
from autofit.search.health import reference_for, REFERENCE_PRECISIONS

BUSY_WAIT_S = 0.5  # how often a config another worker is measuring is looked at again
REFERENCE_ATTEMPTS = 3  # an OOM refits the model; the next frontier point is smaller


def ensure_reference(tuner) -> None:
    """Measure a full-precision reference if the study has none, so low-precision winners
    can be checked: the fastest 32-true (else tf32) config predicted to fit, i.e. the
    largest micro batch with the fewest checkpointed blocks, nothing frozen."""
    space = tuner.space
    precision = next((p for p in REFERENCE_PRECISIONS if p in space.precisions), None)
    if 32 not in space.optimizer_bits:  # every config of the space has 8-bit state
        precision = None
    attempts = 0
    while attempts < REFERENCE_ATTEMPTS:
        records = tuner.records()
        if precision is None or reference_for(None, records, same_freeze=False) is not None:
            return
        line = [c for c in seeding.frontier(space, tuner.fits(records), precision, 0, limit=3,
                                            strategy={"optimizer_bits": 32})
                if tuner.known(c, records) is None]
        if not line:
            break
        if tuner.measure_now(line[0], records, unless_busy=True) is None:
            # Another worker sharing the study is measuring it: its result is the reference
            # (or, if that worker dies, the trial comes back to be measured here).
            if tuner.should_stop():
                return
            time.sleep(BUSY_WAIT_S)
            continue
        attempts += 1
    logger.warning("no {} reference (fp32 optimizer state) fits: numeric health of 16-bit precisions and "
                   "8-bit optimizer state is checked for finite losses and scaler skips only (no stagnation "
                   "or loss-curve comparison)", precision)


def refresh_leaders(tuner, records: list) -> list:
    """The leaders (the search's fastest configs) whose figures are all old (read back from
    another session: another day, another load) or taken under heavy foreign load, measured
    again, interleaved, before any of those figures decides. Returns the records after."""
    since = tuner.session_start
    leaders = choice.rank(records, tuner.budget_bytes, repeats=False)[:choice.MAX_CONTENDERS]

    def trusted(config) -> bool:
        return any(r.config == config and r.measurement is not None and r.fresh(since) and not r.loaded
                   for r in records)

    stale = [r.record for r in leaders if not trusted(r.record.config)]
    if not stale:
        return records
    old = [r.measured_at for r in stale if r.measured_at is not None and r.measured_at < since]
    why = (f"measured {age_text(since - max(old))} to {age_text(since - min(old))} before this run" if old else
           "measured while other work held the host")
    logger.info("measuring the {} leaders again, interleaved, before their figures ({}) decide: {}", len(leaders),
                why, ", ".join(r.record.config.short() for r in leaders))
    for leader in leaders:
        if tuner.should_stop():
            break
        tuner.measure_now(leader.record.config, records, repeat=True)
    return tuner.records()


def age_text(seconds: float) -> str:
    """`3 min`, `2.5 h`, `4 days`: how old a figure is."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def remeasure_contenders(tuner) -> tuple[float | None, int]:
    """Re-measure the configs within noise of the best, interleaved, until the leader's
    lead exceeds the noise seen (MIN_ROUNDS to MAX_ROUNDS rounds). Figures from this session
    decide (old ones are refreshed first); repeats are stored, so a resume does not take
    them again. Returns (noise seen in this session, rounds)."""
    records, budget_bytes, since = tuner.records(), tuner.budget_bytes, tuner.session_start
    records = refresh_leaders(tuner, records)
    first = choice.rank(records, budget_bytes, fresh_since=since)
    field = choice.contenders(first, choice.prior_noise(first))
    if len(field) < 2:
        return choice.observed_noise(records, since), 0
    rounds = min(f.measurements for f in field) - 1
    while rounds < choice.MAX_ROUNDS:
        if rounds >= choice.MIN_ROUNDS:
            ranked = choice.rank(records, budget_bytes, fresh_since=since)
            observed = choice.observed_noise(records, since)
            noise = choice.NOISE_PRIOR if observed is None else observed
            if choice.settled([r for r in ranked if r.record.config in {f.record.config for f in field}], noise):
                break
        for contender in field:
            if tuner.should_stop():
                return choice.observed_noise(records, since), rounds
            tuner.measure_now(contender.record.config, records, repeat=True)
        records = tuner.records()
        rounds += 1
    return choice.observed_noise(records, since), rounds
