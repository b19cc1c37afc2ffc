"""Drop-in adapters for other libraries' RoPE APIs: ``te`` (TransformerEngine 2.20.2)."""
