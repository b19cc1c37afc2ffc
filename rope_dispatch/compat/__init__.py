"""Drop-in adapters for other libraries' RoPE APIs: ``te`` (TransformerEngine 2.20.2) and
``flashinfer`` (the serving engines' in-place q and k call)."""
