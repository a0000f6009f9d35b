"""One module per model family, each registering its architectures with `models.registry` when imported."""
