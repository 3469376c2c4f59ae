"""Files found on the machine: data packages located without importing them."""

from __future__ import annotations

import pytest

from kakeyaturbo import assets


def test_missing_package_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="not installed"):
        assets.package_file("surely_not_installed_pkg_x", "f")
