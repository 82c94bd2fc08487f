"""Global prefix routing: the PrefixIndex of which replica holds which KV blocks."""
