"""Framework-free PyTorch core: masks, attribution, the attention kernel, regularizers."""
