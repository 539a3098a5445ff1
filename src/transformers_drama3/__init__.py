"""Fish Audio Drama 3 for Hugging Face Transformers."""

__version__ = "0.1.0"
