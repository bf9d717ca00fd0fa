"""How batches cross from DataLoader workers to the main process (shared-memory slots)."""
