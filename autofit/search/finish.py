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


def remeasure_contenders(tuner) -> tuple[float | None, int]:
    """Re-measure the configs within noise of the best, interleaved, round after round: a
    contender whose lead is lost beyond doubt (`choice.behind`) leaves the field, a config
    measured once that comes to lead the re-measured ones joins it, and the rounds stop
    when the lead is settled or the leaders are tied under the noise seen
    (`choice.settled`), or when the noise is too large for any number of rounds to settle
    it (`choice.futile`: a loaded host); MIN_ROUNDS to MAX_ROUNDS rounds. Repeats are
    stored, so a resumed study does not take them again. Returns (noise seen, rounds)."""
    records, budget_bytes = tuner.records(), tuner.budget_bytes
    # The field is drawn from the search's own measurements, so a resumed study draws
    # the same one and finds its repeats already taken.
    first = choice.rank(records, budget_bytes, repeats=False)
    prior = choice.prior_noise(first)
    field = [r.record.config for r in choice.contenders(first, prior)]
    if len(field) < 2:
        return choice.observed_noise(records), 0
    while True:
        ranked = choice.rank(records, budget_bytes)
        if ranked[0].record.config not in field:
            # One lucky run is no lead: it is measured as often as the others first (the
            # winner's curse, otherwise).
            field.append(ranked[0].record.config)
        race = [r for r in ranked if r.record.config in field]
        rounds = min(r.measurements for r in race) - 1
        if rounds >= choice.MIN_ROUNDS:
            noise = choice.decision_noise(records, prior)
            race = [r for r in race if not choice.behind(r, race[0], noise)]
            field = [c for c in field if c in {r.record.config for r in race}]
            if (len(race) < 2 or choice.settled(race, noise) or choice.futile(noise)
                    or rounds >= choice.MAX_ROUNDS):
                return choice.observed_noise(records), rounds
        level = {r.record.config for r in race if r.measurements == rounds + 1}
        for config in field:
            if config in level:
                if tuner.should_stop():
                    return choice.observed_noise(records), rounds
                tuner.measure_now(config, records, repeat=True)
        records = tuner.records()
