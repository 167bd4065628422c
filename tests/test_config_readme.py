"""The docs' configuration listing is checked against the config models, so it cannot drift."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rcoder.config import (
    BudgetKeys,
    PermissionRule,
    ProfileBudgetKeys,
    ProfileKeys,
    SettingsKeys,
    builtin_profiles,
    key_descriptions,
    load_settings,
)

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
PERMISSIONS = ROOT / "docs" / "permissions.md"
# every page whose TOML examples must load as a config
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def toml_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```toml\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


def configuration_listing() -> dict[str, Any]:
    """The first TOML block of the configuration page: every key with its default."""
    return tomllib.loads(toml_blocks(CONFIGURATION.read_text())[0])


def test_the_docs_list_every_top_level_key_with_its_default() -> None:
    listed = {key: value for key, value in configuration_listing().items() if key != "agents"}
    assert set(listed) == set(SettingsKeys.model_fields)
    assert dict(SettingsKeys.model_validate(listed)) == dict(SettingsKeys())


def test_the_docs_list_every_profile_key_with_the_built_in_claude_profiles_value() -> None:
    listed = configuration_listing()["agents"]["claude"]
    claude = builtin_profiles()["claude"]
    assert set(listed) == set(ProfileKeys.model_fields)
    # the listing shows the installed agent relative to the repository, the profile wherever it is
    assert Path(listed["command"]).name == Path(claude.command).name
    expected = {key: getattr(claude, key) for key in ProfileKeys.model_fields}
    assert dict(ProfileKeys.model_validate({**listed, "command": claude.command})) == expected


def test_the_docs_permission_rules_use_the_rule_keys() -> None:
    rules = tomllib.loads(toml_blocks(PERMISSIONS.read_text())[0])["agents"]["claude"]["permission_rules"]
    assert {key for rule in rules for key in rule} == set(PermissionRule.model_fields)


@pytest.mark.parametrize("block", [block for page in PAGES for block in toml_blocks(page.read_text())])
def test_every_toml_example_in_the_docs_is_a_valid_config(tmp_path: Path, block: str) -> None:
    path = tmp_path / "rcoder.toml"
    path.write_text(block)
    load_settings(path, {})


def test_the_generated_reference_lists_every_key_with_its_description() -> None:
    """docs/config-reference.md is made from the model when the site is built: each key is a row."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    reference = docs_hooks.config_reference()
    for model in (SettingsKeys, ProfileKeys, PermissionRule, BudgetKeys, ProfileBudgetKeys):
        descriptions = key_descriptions(model)
        for key in model.model_fields:
            assert descriptions.get(key), f"{model.__name__}.{key} has no description (a docstring under the key)"
            assert f"| `{key}` |" in reference
