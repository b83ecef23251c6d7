"""Compatibility with other libraries' spellings of moe-ep's options (`renames`)."""
