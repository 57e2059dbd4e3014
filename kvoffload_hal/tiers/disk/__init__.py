"""The local-disk tier."""
