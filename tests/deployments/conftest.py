"""(Transitional) the e2e fixtures live in tests/conftest.py."""

from tests.helpers import LIMITS  # noqa: F401
