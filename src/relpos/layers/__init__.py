"""nn.Modules built on relpos attention: multi-head attention with a KV cache, T5 layers, Swin window attention."""
