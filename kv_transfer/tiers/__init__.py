"""Storage tiers: host shared-memory arena, disk segments (and remote ByteStores)."""
