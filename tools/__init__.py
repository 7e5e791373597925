"""The repository's tools, a package so that the tests import them as `tools.…`."""
