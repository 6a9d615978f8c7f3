"""autofit's version, as the profiles it writes record it (pyproject.toml's `version`)."""

VERSION = "0.1.0"
