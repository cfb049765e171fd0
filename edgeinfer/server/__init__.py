"""The OpenAI-compatible daemon."""
