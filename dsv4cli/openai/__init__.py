"""The OpenAI API as dsv4 batch and dsv4 serve speak it: request bodies in, completions and chunks out."""
