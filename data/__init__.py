"""Feature stores, the demo corpus, the multi-length batch plan, the device cache and the prefetcher."""
