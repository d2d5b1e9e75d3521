"""GPU plumbing shared by the GPU backends: the memoized RawModule loader."""
