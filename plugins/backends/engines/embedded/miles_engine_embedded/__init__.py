"""The embedded rollout engine: a torch-native server speaking SGLang's native HTTP API.

Importing this package imports neither torch nor transformers; the server process does.
"""

__version__ = "0.1.0"
