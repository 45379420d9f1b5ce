"""Data pipeline: ``.bin``/``.idx`` datasets, GPT-NeoX sample order, blending, splits and loaders."""
