"""The base of every run-spec section, and the bounds its numbers are checked against."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Upper bounds that no run on one machine per learner gets near, so that a typo (an extra zero or
# three) fails at load time instead of as an out-of-memory error or an endless run hours later.
MAX_WIDTH = 8192          # the widest open LLMs' d_model; with 64 layers already far beyond one GPU
MAX_BATCH = 4096          # sequences per step; with seq_len up to 4096, 16M tokens per step
MAX_STEPS = 100_000       # inner steps per round, and outer rounds: days of training at any scale here
MAX_WAIT_S = 7 * 86400    # a week; much larger waits (1e300) overflow time.sleep
MAX_ISLANDS = 64          # sites in one run
MAX_LEARNER_PROCESSES = 1024  # learners x processes_per_learner over all islands: 1024 accelerators
MAX_LIST = 1000           # capacity windows of an island, faults of a run: a window a day for years
# Seeds are derived by arithmetic (the baseline's is seed * 7919 + ...) and must stay below torch's
# 2**64; 2**32 is also numpy's range.
SEED_LIMIT = 2**32


class SpecModel(BaseModel):
    """Base for spec sections: unknown fields are errors, not silently ignored settings; inf and nan
    are refused as numbers; errors never echo the input (it could be a URL with a password in it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, hide_input_in_errors=True)
