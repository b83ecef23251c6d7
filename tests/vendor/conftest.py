"""Fixtures of tests/vendor (defined in vendor_testlib, a uniquely named module)."""

from vendor_testlib import git_upstream, pypi_index, root, vendor

__all__ = ["git_upstream", "pypi_index", "root", "vendor"]
