"""Doors for users of other libraries' models: argument mapping onto rope_dispatch's calls.

``rope_dispatch.integrations.hf``: Hugging Face transformers (needs the ``hf`` extra). The core
package never imports these modules.
"""
