"""The Mooncake Store tier, shared by every instance."""
