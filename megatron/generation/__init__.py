"""Text generation: sampling over the model's KV cache."""
