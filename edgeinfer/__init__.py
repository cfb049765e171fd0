"""edgeinfer: run small quantized language models on the device itself.

Runtime modules never import torch or transformers; the converter lives in `edgeinfer.converters`.
"""

__version__ = "0.1.0"
