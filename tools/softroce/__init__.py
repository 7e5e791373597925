"""The Soft-RoCE guest harness (guest.py): a script, and `tools.softroce.guest` for the tests."""
