"""The chain: tiers in order, what each tier's policy is, write-back, bulk transfer, counters."""
