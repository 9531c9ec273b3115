"""Running a model: the forward pass, the architectures' declarations and the config read
from a file, the KV cache, the loader, the tokenizer and chat template, generation, the
arithmetic policies and the observers."""
