"""``store_url`` picks the store: "" SQLite in data_dir (psycopg never loaded), a postgresql://
URL PostgreSQL, anything else a ConfigError naming the key; the password shows nowhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rcoder.config import load_settings
from rcoder.errors import ConfigError
from rcoder.store import make_store, redact_url
from rcoder.store.postgres import PostgresStore
from rcoder.store.sqlite import SqliteStore

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_an_empty_store_url_is_sqlite_in_data_dir_and_the_daemon_never_loads_psycopg(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rcoder.config import load_settings\n"
        "from rcoder.daemon import STORE_FILE, Daemon\n"
        f"settings = load_settings(None, {{'RCODER_DATA_DIR': {str(tmp_path)!r}}})\n"
        "daemon = Daemon(settings)\n"
        "print(type(daemon.store).__name__, daemon.store._path == settings.data_dir / STORE_FILE,"
        " any(m.split('.')[0] in ('psycopg', 'psycopg_pool') for m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SqliteStore", "True", "False"]


@pytest.mark.parametrize("url", ["postgresql://u:pw@db.example:5432/rcoder", "postgres://db.example/rcoder"])
def test_a_postgresql_url_selects_the_postgresql_store(tmp_path: Path, url: str) -> None:
    store = make_store(url, tmp_path / "rcoder.db", "host-a")
    assert isinstance(store, PostgresStore)
    assert "pw" not in repr(store)
    assert isinstance(make_store("", tmp_path / "rcoder.db", "host-a"), SqliteStore)


@pytest.mark.parametrize("url", ["", "postgresql://u:pw@h/db", "postgres://h/db", "postgresql:///db?host=/run/pg"])
def test_the_store_url_accepts_empty_and_postgresql_urls(url: str) -> None:
    assert load_settings(None, {"RCODER_STORE_URL": url, "RCODER_AUTH_TOKEN": "hosts"}).store_url == url


@pytest.mark.parametrize("url", ["sqlite:///x.db", "mysql://u:pw@h/db", "http://h/db", "/var/lib/rcoder.db", "pg"])
def test_any_other_store_url_is_a_config_error_naming_the_key_and_not_the_value(tmp_path: Path, url: str) -> None:
    config = tmp_path / "rcoder.toml"
    config.write_text(f"store_url = {url!r}\n")
    with pytest.raises(ConfigError) as from_file:
        load_settings(config, {})
    with pytest.raises(ConfigError) as from_env:
        load_settings(None, {"RCODER_STORE_URL": url})
    with pytest.raises(ConfigError) as from_factory:
        make_store(url, tmp_path / "rcoder.db", "host-a")
    assert (from_file.value.key, from_env.value.key, from_factory.value.key) == (
        "store_url",
        "RCODER_STORE_URL",
        "store_url",
    )
    for caught in (from_file, from_env, from_factory):
        assert "postgresql://" in str(caught.value)
        assert url not in str(caught.value)


def test_the_settings_never_show_the_store_url() -> None:
    settings = load_settings(None, {"RCODER_STORE_URL": "postgresql://u:s3cret@h/db", "RCODER_AUTH_TOKEN": "hosts"})
    assert "s3cret" not in repr(settings)
    assert "s3cret" not in str(settings)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:s3cret@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://u:s%40cret@h/db?sslmode=require", "postgresql://u:***@h/db?sslmode=require"),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:s3cret@h1:5432,h2:5433/db", "postgresql://u:***@h1:5432,h2:5433/db"),
        ("postgresql://h/db?user=u&password=s3cret", "postgresql://h/db?user=u&password=***"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("postgres:///db", "postgres:///db"),
        ("postgresql://[::1/db", "<unparsable store_url>"),
    ],
)
def test_a_redacted_url_hides_the_password_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact_url(url) == shown
