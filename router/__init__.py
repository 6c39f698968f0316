"""HTTP side: the only package that knows about OpenAI's API (serving lands with a later issue)."""
