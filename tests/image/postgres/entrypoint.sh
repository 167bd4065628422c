#!/bin/sh
# The official postgres image's first-start contract, as far as deploy/compose.yaml uses it: an
# empty data folder gets a cluster whose superuser is POSTGRES_USER with POSTGRES_PASSWORD, and a
# database POSTGRES_DB; local socket logins are trusted, TCP logins need the password.
set -eu
: "${PGDATA:=/var/lib/postgresql/data}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?the postgres stand-in needs POSTGRES_PASSWORD}"
    user=${POSTGRES_USER:-postgres}
    database=${POSTGRES_DB:-$user}
    password_file=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$password_file"
    initdb --pgdata="$PGDATA" --username="$user" --pwfile="$password_file" --encoding=UTF8 \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$password_file"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$database" != postgres ]; then
        echo "CREATE DATABASE \"$database\"" | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
