"""Storage tiers below the GPU: the pinned host pool and the SSD block store."""
