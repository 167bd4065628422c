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
from rcoder.config_groups import GROUPED_NAME, GROUPS, ungroup

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
    # written in their tables, as a file writes them
    grouped = ungroup({key: value for key, value in configuration_listing().items() if key != "agents"})
    assert (grouped.flat, grouped.problems) == ({}, [])
    listed = grouped.values
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
    settings = load_settings(path, {})
    assert not settings.flat_keys, f"write these in their tables: {dict(settings.flat_keys)}"


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
            if model is not SettingsKeys or key not in GROUPED_NAME:
                assert f"| `{key}` |" in reference


def test_the_generated_reference_lists_each_setting_in_its_table_and_its_flat_name() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    sections = dict(re.findall(r"^## (.*?)\n(.*?)(?=^## |\Z)", docs_hooks.config_reference(), re.M | re.S))
    top = sections["Top-level keys"]
    for table, keys in GROUPS.items():
        rows = sections[f"`[{table}]` keys"]
        for key, setting in keys.items():
            assert f"| `{key}` |" in rows and f"`RCODER_{setting.upper()}`" in rows, (table, key)
            assert f"| `{setting}` | `{table}.{key}` |" in sections["Flat names, read until the next release"]
    for setting in GROUPED_NAME:
        assert f"| `{setting}` |" not in top
