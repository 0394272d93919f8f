"""llmgw: a GitOps control plane for self-hosted LLM inference."""

__version__ = "0.1.0"
