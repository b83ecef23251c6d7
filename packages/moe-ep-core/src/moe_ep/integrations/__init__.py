"""Adapters that put moe-ep under other libraries' models (`transformers`)."""
