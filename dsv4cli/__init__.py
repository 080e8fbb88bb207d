"""dsv4cli: terminal inference for DeepSeek V4 Flash."""
import warnings

# torch warns at import when numpy is absent; nothing here uses numpy, so a fresh install stays quiet.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
