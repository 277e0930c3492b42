"""Suite-wide settings. Under CI (``CI`` set) hypothesis runs derandomized with no example
database, so every CI run checks the same examples and a failure reproduces."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
