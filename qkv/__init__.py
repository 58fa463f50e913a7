"""qkv: the Transformer of "Attention Is All You Need" as a library and command-line tool."""

from qkv.attention import MultiHeadAttention, scaled_dot_product_attention
from qkv.config import ModelConfig, model_preset
from qkv.model import Transformer

__all__ = ["ModelConfig", "MultiHeadAttention", "Transformer", "model_preset", "scaled_dot_product_attention"]
__version__ = "0.1.0"
