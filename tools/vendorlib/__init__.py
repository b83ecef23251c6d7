"""Logic of `tools/vendor.py`: metadata, lock, sources, patches and the commands."""
