"""dsv4cli: terminal inference for DeepSeek V4 Flash."""
