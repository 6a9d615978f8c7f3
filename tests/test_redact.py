"""One redaction for every storage URL autofit prints: status, profiles, errors, log lines."""

import pytest

from autofit.base.redact import redact_text, redact_url

SECRETS = ("s3cret", "p@ss", "p:ss", "p/ss", "a%40b%3Ac%2F", "x?y", "hunter2")


@pytest.mark.parametrize("url, shown", [
    ("postgresql://tuner:s3cret@db.example:5432/autofit", "postgresql://tuner:***@db.example:5432/autofit"),
    # A password with unencoded `@`: the user info runs to the last `@`, not the first.
    ("postgresql://tuner:p@ss@db/autofit", "postgresql://tuner:***@db/autofit"),
    ("postgresql://tuner:p@ss@w@rd@db/autofit", "postgresql://tuner:***@db/autofit"),
    ("postgresql://tuner:p:ss@db/autofit", "postgresql://tuner:***@db/autofit"),
    ("postgresql://tuner:p/ss@db/autofit", "postgresql://tuner:***@db/autofit"),
    ("postgresql+psycopg://tuner:a%40b%3Ac%2F@db/autofit", "postgresql+psycopg://tuner:***@db/autofit"),
    ("mysql://tuner:x?y@db/autofit", "mysql://tuner:***@db/autofit"),
    ("postgresql://tuner:@db/autofit", "postgresql://tuner:***@db/autofit"),  # an empty password: still hidden
    # No password: nothing to hide, the URL is shown whole.
    ("postgresql://tuner@db/autofit", "postgresql://tuner@db/autofit"),
    ("postgresql://db:5432/autofit", "postgresql://db:5432/autofit"),
    ("sqlite:////var/lib/autofit/studies.db", "sqlite:////var/lib/autofit/studies.db"),
    ("sqlite:///state/p@th/studies.db", "sqlite:///state/p@th/studies.db"),
    # A password as a query parameter, as libpq and SQLAlchemy accept it.
    ("postgresql://tuner@db/autofit?password=hunter2&sslmode=require",
     "postgresql://tuner@db/autofit?password=***&sslmode=require"),
    ("host=db user=tuner password=hunter2 dbname=autofit", "host=db user=tuner password=*** dbname=autofit"),
    ("in-memory", "in-memory"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert not any(secret in redact_url(url) for secret in SECRETS)


def test_a_url_with_an_at_in_its_query_may_lose_more_than_its_password_but_never_less():
    shown = redact_url("postgresql://tuner:s3cret@db/autofit?application_name=a@b")
    assert "s3cret" not in shown and shown.startswith("postgresql://tuner:***@")


def test_redact_text_finds_every_url_in_a_message():
    text = ("--storage postgresql://tuner:p@ss@db/autofit: cannot open the study storage: "
            "(psycopg.OperationalError) connection to 'mysql://u:p:ss@other/x' failed")
    shown = redact_text(text)
    assert "p@ss" not in shown and "p:ss" not in shown
    assert "postgresql://tuner:***@db/autofit:" in shown and "mysql://u:***@other/x'" in shown
    assert redact_text("nothing secret here") == "nothing secret here"
