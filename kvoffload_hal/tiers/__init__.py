"""Secondary tiers behind the CPU tier (disk first)."""
