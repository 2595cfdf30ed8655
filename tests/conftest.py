"""Test-wide settings (kept minimal: fixtures live next to their tests)."""

from collections.abc import Iterator

import pytest
from hypothesis import settings

from quantobs import native

# Per-example deadlines measure torch's first-call warm-up and the load of a
# 2-core CI machine, not our code: switch them off.
settings.register_profile("quantobs", deadline=None, print_blob=True)
settings.load_profile("quantobs")


@pytest.fixture(params=["native", "eager"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the native kernels (when they build) and without."""
    previous = native.set_enabled(True)
    if request.param == "native" and not native.available():
        native.set_enabled(previous)
        pytest.skip("no C compiler: the native kernels are not built")
    native.set_enabled(request.param == "native")
    yield request.param
    native.set_enabled(previous)
