"""Test-wide settings (kept minimal: fixtures live next to their tests)."""

from hypothesis import settings

# Per-example deadlines measure torch's first-call warm-up and the load of a
# 2-core CI machine, not our code: switch them off.
settings.register_profile("quantobs", deadline=None, print_blob=True)
settings.load_profile("quantobs")
