"""periodic_async: on-policy periodic asynchrony for GRPO-style RL of causal LMs.

A reproduction of "Periodic Asynchrony: An On-Policy Approach for Accelerating LLM
Reinforcement Learning" (arXiv 2511.18871). Inference engines and the trainer run as a
producer-consumer pipeline; the trainer steps once per iteration and syncs weights at a
barrier, so every sample of iteration t comes from the policy of version t.
"""

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "GRPOTrainer", "__version__"]


def __getattr__(name: str):
    """`from periodic_async import GRPOTrainer, GRPOConfig`: TRL's interface (trl_api/), imported on first use."""
    if name in ("GRPOConfig", "GRPOTrainer"):
        from periodic_async import trl_api

        return getattr(trl_api, name)
    raise AttributeError(f"module 'periodic_async' has no attribute {name!r}")
