"""The four default specialists' domains and the corpus splits."""

DOMAINS: tuple[str, ...] = ("cpp", "python", "build", "shell")
SPLITS: tuple[str, ...] = ("train", "validation", "test")
