"""What persists across engine steps (paged KV, SSM state slots), and its rollback."""
