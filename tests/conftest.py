"""Suite-wide settings. Hypothesis runs derandomized with no example database, so every run
of the suite (CI's and the README's command alike) checks the same examples and a failure
reproduces; ``SHARDKIT_HYPOTHESIS_EXPLORE=1`` draws new examples each run instead (for looking
for failures, not for CI)."""

import os

from hypothesis import settings

settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("SHARDKIT_HYPOTHESIS_EXPLORE") else "fixed")
