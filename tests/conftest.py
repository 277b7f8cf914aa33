"""pytest configuration: fixtures shared by every test folder."""

import pytest

from support import MOONCAKE


@pytest.fixture
def mooncake_path():
    if not MOONCAKE.exists():
        pytest.skip(f"reference trace not found at {MOONCAKE} (../shared/data is absent)")
    return MOONCAKE
